//! Gemma 3 vision against the reference implementation, Python mlx-vlm, on
//! the same generated weights: the same prompt ids and the same pixel
//! tensor in, the same greedy tokens (and logits within float tolerance)
//! out. Prefill runs whole and in chunks that cut through an image (causal)
//! or end after it (bidirectional image attention, compared with mlx-vlm's
//! model given Hugging Face's mask: causal, or within the same image).
//! Gemma 4 likewise, with each image's features compared too.
//! (The pixels path, decoding and resizing, is compared against mlx-vlm's
//! processor in the gateway's end-to-end vision test.)

use std::path::{Path, PathBuf};
use std::sync::Arc;

use engine_core::ImageInput;
use fixtures::gemma4::{Gemma4Shape, Layout};
use fixtures::model::random_prompt;
use fixtures::model::TinySpec;
use fixtures::vision::{
    write_gemma4_vision_model, write_vision_model, TinyGemma4VisionSpec, TinyVisionSpec,
};
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::{argmax_tokens, tokens_array};
use runtime::model::Logits;
use runtime::vision::{chunk_end, image_spans, replacement, TowerKind};
use runtime::LoadedModel;

const STEPS: usize = 24;

struct Reference {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn reference(
    dir: &Path,
    cases: &[(Vec<u32>, PathBuf, usize)],
    bidirectional: bool,
) -> Vec<Reference> {
    let cases: Vec<_> = cases
        .iter()
        .map(|(ids, pixels, n)| serde_json::json!({ "ids": ids, "pixels": pixels, "images": n, "bidirectional": bidirectional }))
        .collect();
    let req = serde_json::json!({ "model": dir, "cases": cases, "max_tokens": STEPS });
    let v = fixtures::reference::run("mlx_vlm_oracle.py", &req);
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Reference {
            tokens: serde_json::from_value(r["tokens"].clone()).unwrap(),
            logits: serde_json::from_value(r["logits"].clone()).unwrap(),
        })
        .collect()
}

/// Deterministic pixels in [-1, 1], `[n, size, size, 3]`.
fn pixels(seed: u64, n: usize, size: usize) -> Vec<f32> {
    random_prompt(seed, n * size * size * 3, 2001)
        .into_iter()
        .map(|v| v as f32 / 1000.0 - 1.0)
        .collect()
}

/// `text` ids with an image's `<start_of_image>`, soft tokens and
/// `<end_of_image>` inserted at each of `at`.
fn prompt_with_images(
    text: &[u32],
    at: &[usize],
    boi: u32,
    soft: u32,
    eoi: u32,
    per: usize,
) -> Vec<u32> {
    let mut out = vec![2]; // <bos>
    for (i, &t) in text.iter().enumerate() {
        if at.contains(&i) {
            out.push(boi);
            out.extend(std::iter::repeat_n(soft, per));
            out.push(eoi);
        }
        out.push(t);
    }
    out
}

/// Greedy tokens and per-step logits, prefilling in chunks of `chunk`.
fn ours(model: &LoadedModel, prompt: &[u32], images: &[ImageInput], chunk: usize) -> Reference {
    let m = &model.model;
    let mut cache = m.new_cache(1);
    let mut logits = None;
    let mut start = 0;
    while start < prompt.len() {
        let end = chunk_end(images, start, (start + chunk).min(prompt.len()));
        let ids = tokens_array(&prompt[start..end]);
        let out = match replacement(images, start, end - start) {
            Some(r) => m.forward_replacing(&ids, &r, &mut cache, Logits::Last),
            None => m.forward(&ids, &mut cache, Logits::Last),
        }
        .unwrap();
        logits = Some(out);
        start = end;
    }
    let mut logits = logits.unwrap();
    let (mut tokens, mut rows) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let last = logits.reshape(&[-1]).unwrap();
        eval([&last]).unwrap();
        rows.push(last.as_slice::<f32>().to_vec());
        let t = argmax_tokens(&logits).unwrap();
        let t = t.as_slice::<i32>()[0] as u32;
        tokens.push(t);
        logits = m
            .forward(&tokens_array(&[t]), &mut cache, Logits::Last)
            .unwrap();
    }
    Reference {
        tokens,
        logits: rows,
    }
}

/// bf16: logits within `tol` and the same tokens while the two runs see
/// the same tokens; they may part only where the reference's best two
/// logits are within `tol` (a tie at bf16's resolution), and after that
/// their inputs differ, so nothing more is compared.
/// Our greedy run of one case, after checking what must hold whatever
/// the reference says: with `chunked`, prefill in chunks of 7 (which cut
/// every image's soft tokens, or end after them) gives the same tokens;
/// bidirectional images change the logits against causal ones.
fn ours_checked(
    model: &LoadedModel,
    prompt: &[u32],
    images: &[ImageInput],
    case: usize,
    chunked: bool,
) -> Reference {
    let whole = ours(model, prompt, images, usize::MAX);
    if chunked {
        let pieces = ours(model, prompt, images, 7);
        assert_eq!(
            whole.tokens, pieces.tokens,
            "case {case}: chunked prefill changed the tokens"
        );
    }
    if images.iter().any(|im| im.bidirectional) {
        let causal: Vec<ImageInput> = images
            .iter()
            .map(|im| ImageInput {
                bidirectional: false,
                ..im.clone()
            })
            .collect();
        let causal = ours(model, prompt, &causal, usize::MAX);
        assert_ne!(
            causal.logits[0], whole.logits[0],
            "case {case}: bidirectional attention changed nothing"
        );
    }
    whole
}

/// Our greedy tokens equal the reference's, and our logits lie within 2e-3.
fn assert_matches_reference(case: usize, mine: &Reference, tokens: &[u32], logits: &[Vec<f32>]) {
    assert_eq!(
        mine.tokens, tokens,
        "case {case}: greedy tokens differ from mlx-vlm"
    );
    let worst = fixtures::reference::worst_difference(&mine.logits, logits);
    eprintln!(
        "case {case}: tokens {:?}, worst logit difference {worst:e}",
        mine.tokens
    );
    assert!(
        worst < 2e-3,
        "case {case}: logits differ from mlx-vlm by {worst}"
    );
}

fn agree_up_to_a_near_tie(case: usize, mine: &Reference, theirs: &Reference, tol: f32) {
    for (step, (a, b)) in mine.logits.iter().zip(&theirs.logits).enumerate() {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < tol,
            "case {case} step {step}: logits differ by {worst}"
        );
        if mine.tokens[step] != theirs.tokens[step] {
            let mut sorted = b.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let gap = sorted[0] - sorted[1];
            assert!(
                gap < tol,
                "case {case} step {step}: tokens differ with a logit gap of {gap}"
            );
            eprintln!("case {case}: bf16 near-tie at step {step} (gap {gap:e})");
            return;
        }
    }
}

#[test]
fn gemma3_vision_matches_mlx_vlm() {
    check_against_mlx_vlm(false, Dtype::Float32);
}

/// bf16 weights and activations (tower included): tokens only, as for the
/// text families' bf16 oracle.
#[test]
fn gemma3_vision_bf16_matches_mlx_vlm() {
    check_against_mlx_vlm(false, Dtype::Bfloat16);
}

#[test]
fn bidirectional_image_attention_matches_mlx_vlm_given_the_same_mask() {
    check_against_mlx_vlm(true, Dtype::Float32);
}

fn check_against_mlx_vlm(bidirectional: bool, dtype: Dtype) {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = TinyVisionSpec::tiny();
    spec.text.dtype = dtype;
    let exact = dtype == Dtype::Float32;
    if bidirectional {
        // The reference takes one mask for every layer: no window may bite.
        spec.text.sliding_window = 128;
    }
    write_vision_model(dir.path(), &spec).unwrap();
    let model = LoadedModel::load(dir.path(), None).unwrap();
    let tower = model.vision.as_ref().expect("a vision tower");
    let cfg = tower.config.clone();
    let TowerKind::Gemma3 {
        image_size,
        tokens_per_image,
        ..
    } = cfg.tower
    else {
        panic!("a Gemma 3 tower")
    };
    let (size, per) = (image_size as usize, tokens_per_image as usize);
    let text_vocab = spec.text.vocab as u32;
    let (boi, eoi, soft) = (cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id);
    assert_eq!(
        (boi, eoi, soft),
        (text_vocab, text_vocab + 1, text_vocab + 2)
    );

    // One image early in a prompt longer than the sliding window, and two
    // images in one prompt.
    let cases = [
        (
            prompt_with_images(&random_prompt(1, 30, text_vocab), &[3], boi, soft, eoi, per),
            1,
            11,
        ),
        (
            prompt_with_images(
                &random_prompt(2, 12, text_vocab),
                &[1, 7],
                boi,
                soft,
                eoi,
                per,
            ),
            2,
            12,
        ),
    ];
    let mut files = Vec::new();
    let mut ours_by_case = Vec::new();
    for (i, (prompt, n, seed)) in cases.iter().enumerate() {
        let px = pixels(*seed, *n, size);
        let file = dir.path().join(format!("pixels{i}.f32"));
        let bytes: Vec<u8> = px.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&file, bytes).unwrap();
        files.push((prompt.clone(), file, *n));

        let input = Array::from_slice(&px, &[*n as i32, size as i32, size as i32, 3]);
        let features = tower
            .forward(&input)
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        eval([&features]).unwrap();
        let width = features.dim(2) as u32;
        let flat = features.as_slice::<f32>();
        let spans = image_spans(prompt, soft);
        assert_eq!(spans.len(), *n);
        let images: Vec<ImageInput> = spans
            .iter()
            .enumerate()
            .map(|(k, &(start, len))| ImageInput {
                start: start as u32,
                tokens: len as u32,
                width,
                embeddings: Arc::new(
                    flat[k * len * width as usize..(k + 1) * len * width as usize].to_vec(),
                ),
                bidirectional,
            })
            .collect();
        ours_by_case.push(ours_checked(&model, prompt, &images, i, exact));
    }

    let refs = reference(dir.path(), &files, bidirectional);
    for (i, (mine, theirs)) in ours_by_case.iter().zip(&refs).enumerate() {
        if !exact {
            agree_up_to_a_near_tie(i, mine, theirs, 2e-2);
            continue;
        }
        assert_matches_reference(i, mine, &theirs.tokens, &theirs.logits);
        // The image must matter: text-only decoding gives other logits.
        let text_only: Vec<u32> = files[i].0.clone();
        let plain = ours(&model, &text_only, &[], usize::MAX);
        assert_ne!(
            plain.logits[0], mine.logits[0],
            "case {i}: the image changed nothing"
        );
    }
}

// Gemma 4: the tower on images of their own sizes (soft-token counts differ),
// the features against mlx-vlm's `encode_image`, then greedy decoding.

/// Deterministic pixels in [0, 1] (what Gemma 4's processor gives the
/// tower), `[h, w, 3]`.
fn unit_pixels(seed: u64, h: usize, w: usize) -> Vec<f32> {
    random_prompt(seed, h * w * 3, 1001)
        .into_iter()
        .map(|v| v as f32 / 1000.0)
        .collect()
}

struct Gemma4Case {
    prompt: Vec<u32>,
    /// (height, width, seed) of each image, in prompt order.
    images: Vec<(usize, usize, u64)>,
}

fn check_gemma4_against_mlx_vlm(spec: TinyGemma4VisionSpec) {
    let dir = tempfile::tempdir().unwrap();
    let bidirectional = spec.bidirectional;
    write_gemma4_vision_model(dir.path(), &spec).unwrap();
    let model = LoadedModel::load(dir.path(), None).unwrap();
    let tower = model.vision.as_ref().expect("a vision tower");
    let cfg = tower.config.clone();
    assert_eq!(cfg.bidirectional_images, bidirectional);
    let text_vocab = spec.text.vocab as u32;
    let (boi, eoi, soft) = (cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id);
    assert_eq!(
        (boi, eoi, soft),
        (text_vocab, text_vocab + 1, text_vocab + 2)
    );
    let with_images = |text: Vec<u32>, at: &[usize], shapes: &[(usize, usize, u64)]| {
        let mut out = vec![2];
        let mut next = shapes.iter();
        for (i, &t) in text.iter().enumerate() {
            if at.contains(&i) {
                let &(h, w, _) = next.next().unwrap();
                let n = cfg.soft_tokens(w as u32, h as u32).unwrap();
                out.push(boi);
                out.extend(std::iter::repeat_n(soft, n));
                out.push(eoi);
            }
            out.push(t);
        }
        Gemma4Case {
            prompt: out,
            images: shapes.to_vec(),
        }
    };
    // One square image early in a prompt longer than the sliding window (16
    // soft tokens); then a tall image (12) and a square one in a short prompt.
    let cases = [
        with_images(random_prompt(1, 30, text_vocab), &[3], &[(32, 32, 11)]),
        with_images(
            random_prompt(2, 12, text_vocab),
            &[1, 7],
            &[(48, 16, 12), (32, 32, 13)],
        ),
    ];
    let mut requests = Vec::new();
    let mut ours_by_case = Vec::new();
    let mut features_by_case = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut all = Vec::new();
        let mut features = Vec::new();
        for &(h, w, seed) in &case.images {
            let px = unit_pixels(seed, h, w);
            all.extend_from_slice(&px);
            let input = Array::from_slice(&px, &[1, h as i32, w as i32, 3]);
            let f = tower
                .forward(&input)
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap();
            eval([&f]).unwrap();
            features.push((f.dim(2) as u32, f.as_slice::<f32>().to_vec()));
        }
        let file = dir.path().join(format!("pixels{i}.f32"));
        let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&file, bytes).unwrap();
        let shapes: Vec<[usize; 2]> = case.images.iter().map(|&(h, w, _)| [h, w]).collect();
        requests.push(serde_json::json!({
            "ids": case.prompt, "pixels": file, "shapes": shapes, "bidirectional": bidirectional,
        }));

        let spans = image_spans(&case.prompt, soft);
        assert_eq!(spans.len(), case.images.len());
        let images: Vec<ImageInput> = spans
            .iter()
            .zip(&features)
            .map(|(&(start, len), (width, f))| {
                assert_eq!(f.len(), len * *width as usize, "case {i}: soft-token count");
                ImageInput {
                    start: start as u32,
                    tokens: len as u32,
                    width: *width,
                    embeddings: Arc::new(f.clone()),
                    bidirectional,
                }
            })
            .collect();
        let whole = ours_checked(&model, &case.prompt, &images, i, true);
        let plain = ours(&model, &case.prompt, &[], usize::MAX);
        assert_ne!(
            plain.logits[0], whole.logits[0],
            "case {i}: the image changed nothing"
        );
        ours_by_case.push(whole);
        features_by_case.push(features);
    }

    let req = serde_json::json!({ "model": dir.path(), "cases": requests, "max_tokens": STEPS });
    let answer = fixtures::reference::run("mlx_vlm_oracle.py", &req);
    let results = answer["results"].as_array().unwrap();
    for (i, r) in results.iter().enumerate() {
        // The reference's features go into the prompt after the text
        // model's scale; ours are divided by it first (`feature_divisor`).
        let theirs: Vec<Vec<f32>> = serde_json::from_value(r["features"].clone()).unwrap();
        for (k, ((_, mine), theirs)) in features_by_case[i].iter().zip(&theirs).enumerate() {
            assert_eq!(
                mine.len(),
                theirs.len(),
                "case {i} image {k}: feature count"
            );
            let (worst, largest) = mine
                .iter()
                .zip(theirs)
                .fold((0f32, 0f32), |(w, l), (a, b)| {
                    let a = a * cfg.feature_divisor;
                    (w.max((a - b).abs()), l.max(b.abs()))
                });
            eprintln!(
                "case {i} image {k}: worst feature difference {worst:e} (largest feature {largest})"
            );
            assert!(
                worst < 1e-4,
                "case {i} image {k}: features differ from mlx-vlm's by {worst}"
            );
        }
        let tokens = fixtures::reference::token_ids(&r["tokens"]);
        let logits: Vec<Vec<f32>> = serde_json::from_value(r["logits"].clone()).unwrap();
        let mine = &ours_by_case[i];
        assert_matches_reference(i, mine, &tokens, &logits);
    }
}

#[test]
fn gemma4_vision_matches_mlx_vlm() {
    check_gemma4_against_mlx_vlm(TinyGemma4VisionSpec::tiny(Layout::HfMultimodal));
}

/// mlx-community's names (`vision_tower.*`, `embed_vision.*` at the top).
#[test]
fn gemma4_vision_in_the_mlx_layout_matches_mlx_vlm() {
    check_gemma4_against_mlx_vlm(TinyGemma4VisionSpec::tiny(Layout::Mlx));
}

/// An mlx-community-style conversion with the tower's linear layers (and
/// the text model's) quantized to 8 bits in groups of 32.
#[test]
fn gemma4_quantized_vision_matches_mlx_vlm() {
    let mut spec = TinyGemma4VisionSpec::tiny(Layout::Mlx);
    spec.text.quant_bits = Some(8);
    check_gemma4_against_mlx_vlm(spec);
}

/// E2B-like text model: soft tokens read the per-layer input table at id 0.
#[test]
fn gemma4_e2b_vision_matches_mlx_vlm() {
    let mut shape = Gemma4Shape::e2b(6);
    shape.layout = Layout::HfMultimodal;
    check_gemma4_against_mlx_vlm(TinyGemma4VisionSpec {
        text: TinySpec::gemma4(shape),
        ..TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)
    });
}

/// `use_bidirectional_attention: vision`: against mlx-vlm's model given
/// Hugging Face's Gemma 4 masks (sliding layers open within an image,
/// full-attention layers causal).
#[test]
fn gemma4_bidirectional_image_attention_matches_mlx_vlm_given_hf_masks() {
    check_gemma4_against_mlx_vlm(TinyGemma4VisionSpec {
        bidirectional: true,
        ..TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)
    });
}
