//! Image requests in the batched engine, on the tiny Gemma 3 vision model:
//! image and text-only requests submitted together, so they share prefill
//! steps and the decode batch, each get the tokens they get alone; and the
//! KV reservation counts the image soft tokens before admission.

use std::sync::Arc;

use batched::{BatchedConfig, BatchedEngine};
use engine_core::{Engine, EngineError, Event, EventStream, GenerateRequest, ImageInput};
use fixtures::model::random_prompt;
use fixtures::vision::{write_vision_model, TinyVisionSpec};
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::{self, argmax_tokens, tokens_array};
use runtime::model::Logits;
use runtime::paged::KvLayout;
use runtime::vision::{image_spans, replacement, TowerKind};
use runtime::{KvPool, LoadedModel, SharedModel};

fn setup(pool_blocks: usize) -> (tempfile::TempDir, Arc<SharedModel>, BatchedEngine) {
    setup_with(pool_blocks, KvLayout::Contiguous)
}

fn setup_with(
    pool_blocks: usize,
    kv_layout: KvLayout,
) -> (tempfile::TempDir, Arc<SharedModel>, BatchedEngine) {
    let dir = tempfile::tempdir().unwrap();
    write_vision_model(dir.path(), &TinyVisionSpec::tiny()).unwrap();
    let model = LoadedModel::load(dir.path(), Some("tiny-vision")).unwrap();
    let bytes = model.model.config.kv_bytes_per_token(4, None);
    let pool = KvPool::new(pool_blocks, 16, bytes * 16);
    let shared = Arc::new(SharedModel::with_layout(model, pool, 16, kv_layout).unwrap());
    let cfg = BatchedConfig {
        prefill_chunk: Some(8),
        ..Default::default()
    };
    let engine = BatchedEngine::new("batched".into(), shared.clone(), cfg);
    (dir, shared, engine)
}

/// A prompt of `text` ids with one image after the first `at` of them, and
/// its image input (the tower run on pseudo-random pixels from `seed`).
fn image_request(
    shared: &SharedModel,
    text: &[u32],
    at: usize,
    seed: u64,
) -> (Vec<u32>, Vec<ImageInput>) {
    let tower = shared.model.vision.as_ref().unwrap();
    let cfg = &tower.config;
    let TowerKind::Gemma3 {
        image_size: size,
        tokens_per_image,
        ..
    } = cfg.tower
    else {
        panic!("a Gemma 3 tower")
    };
    let mut prompt = vec![2];
    prompt.extend_from_slice(&text[..at]);
    prompt.push(cfg.boi_token_id);
    prompt.extend(std::iter::repeat_n(
        cfg.image_token_id,
        tokens_per_image as usize,
    ));
    prompt.push(cfg.eoi_token_id);
    prompt.extend_from_slice(&text[at..]);
    let pixels: Vec<f32> = random_prompt(seed, (size * size * 3) as usize, 2001)
        .into_iter()
        .map(|v| v as f32 / 1000.0 - 1.0)
        .collect();
    let features = tower
        .forward(&Array::from_slice(&pixels, &[1, size, size, 3]))
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap();
    eval([&features]).unwrap();
    let (start, len) = image_spans(&prompt, cfg.image_token_id)[0];
    let image = ImageInput {
        start: start as u32,
        tokens: len as u32,
        width: features.dim(2) as u32,
        embeddings: Arc::new(features.as_slice::<f32>().to_vec()),
        bidirectional: false,
    };
    (prompt, vec![image])
}

/// Greedy tokens of one request run alone, outside the engine.
fn alone(shared: &SharedModel, prompt: &[u32], images: &[ImageInput], n: usize) -> Vec<u32> {
    let m = &shared.model.model;
    let mut cache = m.new_cache(1);
    let ids = tokens_array(prompt);
    let mut logits = match replacement(images, 0, prompt.len()) {
        Some(r) => m.forward_replacing(&ids, &r, &mut cache, Logits::Last),
        None => m.forward(&ids, &mut cache, Logits::Last),
    }
    .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax_tokens(&logits).unwrap().as_slice::<i32>()[0] as u32;
        out.push(t);
        logits = m
            .forward(&tokens_array(&[t]), &mut cache, Logits::Last)
            .unwrap();
    }
    out
}

fn collect(mut stream: EventStream) -> Vec<u32> {
    let mut tokens = Vec::new();
    loop {
        match stream
            .blocking_recv()
            .expect("stream ended without Finished")
        {
            Event::Token(t) => tokens.push(t.id),
            Event::Finished(_) => return tokens,
            Event::Error(e) => panic!("engine error: {e}"),
        }
    }
}

#[test]
fn image_and_text_requests_together_match_each_alone() {
    for layout in [KvLayout::Contiguous, KvLayout::Paged] {
        together_match_each_alone(layout);
    }
}

/// Image prompts chunked at the image (its tokens attend both ways) and
/// text prompts in one batch, in either cache layout.
fn together_match_each_alone(layout: KvLayout) {
    let (_dir, shared, engine) = setup_with(1024, layout);
    let steps = 16;
    let mut requests = Vec::new();
    for (i, (len, image_at)) in [
        (12, Some(3)),
        (9, None),
        (20, Some(0)),
        (30, None),
        (5, Some(5)),
    ]
    .into_iter()
    .enumerate()
    {
        let text = random_prompt(i as u64 + 7, len, 500);
        requests.push(match image_at {
            Some(at) => image_request(&shared, &text, at, i as u64),
            None => (text, Vec::new()),
        });
    }
    let expected: Vec<Vec<u32>> = {
        let _device = shared.lock_device();
        requests
            .iter()
            .map(|(p, images)| alone(&shared, p, images, steps))
            .collect()
    };
    let streams: Vec<_> = requests
        .iter()
        .map(|(p, images)| {
            let mut req = GenerateRequest::new(p.clone(), steps as u32);
            req.images = images.clone();
            engine.submit(req).unwrap()
        })
        .collect();
    for (i, (stream, want)) in streams.into_iter().zip(&expected).enumerate() {
        assert_eq!(&collect(stream), want, "request {i}, {layout:?}");
    }
    // Text-only greedy is the plain raw loop's.
    let text = &requests[1].0;
    let plain = generate::greedy(&shared.model.model, text, steps, &[], |_| true).unwrap();
    assert_eq!(plain.tokens, expected[1]);
    engine.shutdown();
}

#[test]
fn kv_reservation_counts_image_tokens() {
    // Four blocks of 16: 64 tokens in the whole pool.
    let (_dir, shared, engine) = setup(4);
    let text = random_prompt(3, 10, 500);
    let (with_image, images) = image_request(&shared, &text, 2, 1);
    assert!(with_image.len() >= text.len() + 18);
    // Text alone plus 40 new tokens fits; with the image's 18 more it
    // never can.
    let fits = engine
        .submit(GenerateRequest::new(text.clone(), 40))
        .unwrap();
    collect(fits);
    let mut req = GenerateRequest::new(with_image, 40);
    req.images = images.clone();
    match engine.submit(req) {
        Err(EngineError::Invalid(message)) => assert!(message.contains("block"), "{message}"),
        other => panic!("expected a never-fits error, got {:?}", other.map(|_| ())),
    }
    // Misplaced image embeddings are refused, not run.
    let mut bad = GenerateRequest::new(text, 4);
    bad.images = images;
    assert!(matches!(engine.submit(bad), Err(EngineError::Invalid(_))));
    engine.shutdown();
}
