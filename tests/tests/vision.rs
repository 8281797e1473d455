//! Images in chat requests, end to end on the tiny Gemma 3 and Gemma 4
//! vision models with the real batched and fast-path plugins: greedy tokens
//! and logprobs equal mlx-vlm's (its own processor and chat template on the
//! same image),
//! the feature cache skips the tower for a repeated image, image and text
//! requests batched together get their tokens alone, image soft tokens
//! count against the context, routing keeps images off engines that do not
//! take them, and bad images get clear 400s.

use std::io::{Cursor, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use e2e_tests::{models, Gateway};
use image::{ImageFormat, Rgb, RgbImage};
use serde_json::{json, Value};

const MODEL: &str = "tiny-gemma3-vision";

/// A generated vision model under test: its name, directory, and picture
/// sizes (width, height) its processor takes without resizing.
struct Vlm {
    name: &'static str,
    path: fn() -> &'static Path,
    sizes: [(u32, u32); 2],
}

const GEMMA3: Vlm = Vlm {
    name: MODEL,
    path: models::tiny_gemma3_vision,
    sizes: [(56, 56), (56, 56)],
};

/// 16 and 12 soft tokens.
const GEMMA4: Vlm = Vlm {
    name: "tiny-gemma4-vision",
    path: models::tiny_gemma4_vision,
    sizes: [(32, 32), (16, 48)],
};

fn config(policy: &str, vision: &str) -> String {
    config_for(&GEMMA3, policy, vision)
}

fn config_for(vlm: &Vlm, policy: &str, vision: &str) -> String {
    format!(
        r#"model: {{ path: "{}", kv_cache_mb: 64 }}
engines:
  batched: {{ kind: batched }}
  fastpath: {{ kind: fastpath }}
{policy}
vision: {vision}
"#,
        (vlm.path)().display()
    )
}

const BATCHED_ONLY: &str = "policy: { default: batched }";

/// A deterministic picture of `w` x `h` pixels; `seed` changes it.
fn picture(w: u32, h: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = |k: u32| ((x * (7 + k + seed) + y * (13 + 2 * k) + seed * 31) % 256) as u8;
        Rgb([v(0), v(1), v(2)])
    })
}

fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format).unwrap();
    out.into_inner()
}

fn data_url(bytes: &[u8], mime: &str) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn chat(parts: Vec<Value>, max_tokens: u32) -> Value {
    chat_for(&GEMMA3, parts, max_tokens)
}

fn chat_for(vlm: &Vlm, parts: Vec<Value>, max_tokens: u32) -> Value {
    json!({"model": vlm.name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "logprobs": true, "messages": [{"role": "user", "content": parts}]})
}

/// The generated tokens' texts and logprobs of a chat response.
fn tokens(r: &Value) -> (Vec<String>, Vec<f64>) {
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    (
        content
            .iter()
            .map(|t| t["token"].as_str().unwrap().to_owned())
            .collect(),
        content
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect(),
    )
}

fn post_ok(gw: &Gateway, body: &Value) -> Value {
    let r = gw.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn oracle(req: &Value) -> Value {
    fixtures::reference::run("mlx_vlm_oracle.py", req)
}

#[test]
fn greedy_tokens_match_mlx_vlm_through_the_api() {
    greedy_tokens_match_mlx_vlm(&GEMMA3);
}

/// Two images of their own soft-token counts (16 and 12).
#[test]
fn gemma4_greedy_tokens_match_mlx_vlm_through_the_api() {
    greedy_tokens_match_mlx_vlm(&GEMMA4);
}

fn greedy_tokens_match_mlx_vlm(vlm: &Vlm) {
    let dir = tempfile::tempdir().unwrap();
    let model = (vlm.path)();
    let tokenizer = text::Tokenizer::from_dir(model).unwrap();
    // Pictures at sizes the processor keeps, so no resampling is involved
    // (resizing is compared separately, with a tolerance).
    let pictures: Vec<PathBuf> = (0..2)
        .map(|i| {
            let path = dir.path().join(format!("p{i}.png"));
            let (w, h) = vlm.sizes[i as usize];
            std::fs::write(&path, encode(&picture(w, h, i), ImageFormat::Png)).unwrap();
            path
        })
        .collect();
    let url = |i: usize| data_url(&std::fs::read(&pictures[i]).unwrap(), "image/png");
    let steps = 16;
    let cases = [
        (
            vec![
                json!({"type": "text", "text": "What is in the picture?"}),
                image_part(&url(0)),
            ],
            vec![
                json!({"type": "text", "text": "What is in the picture?"}),
                json!({"type": "image"}),
            ],
            vec![0],
        ),
        (
            vec![
                image_part(&url(1)),
                json!({"type": "text", "text": "and"}),
                image_part(&url(0)),
            ],
            vec![
                json!({"type": "image"}),
                json!({"type": "text", "text": "and"}),
                json!({"type": "image"}),
            ],
            vec![1, 0],
        ),
    ];
    let gw = Gateway::start(&config_for(vlm, BATCHED_ONLY, "{}"));
    let reference = oracle(&json!({
        "model": model,
        "processor": cases.iter().map(|(_, template, images)| json!({
            "messages": [{"role": "user", "content": template}],
            "images": images.iter().map(|&i| &pictures[i]).collect::<Vec<_>>(),
            "max_tokens": steps,
        })).collect::<Vec<_>>(),
    }));
    for (k, (parts, _, _)) in cases.iter().enumerate() {
        let ours = post_ok(&gw, &chat_for(vlm, parts.clone(), steps));
        let theirs = &reference["processed"][k];
        let ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
        assert_eq!(
            ours["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            ids.len(),
            "case {k}: prompt length differs from mlx-vlm's processor"
        );
        let their_tokens: Vec<u32> = serde_json::from_value(theirs["tokens"].clone()).unwrap();
        let their_texts: Vec<String> = their_tokens
            .iter()
            .map(|&t| tokenizer.decode(&[t], false).unwrap())
            .collect();
        let their_logprobs: Vec<f64> = serde_json::from_value(theirs["logprobs"].clone()).unwrap();
        let (texts, logprobs) = tokens(&ours);
        eprintln!(
            "{} case {k}: {} prompt tokens, {texts:?}",
            vlm.name,
            ids.len()
        );
        assert_eq!(
            texts, their_texts,
            "case {k}: greedy tokens differ from mlx-vlm"
        );
        for (a, b) in logprobs.iter().zip(&their_logprobs) {
            assert!(
                (a - b).abs() < 1e-3,
                "case {k}: logprobs {logprobs:?} vs {their_logprobs:?}"
            );
        }
    }
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-4, "logprobs {a:?} vs {b:?}");
    }
}

#[test]
fn feature_cache_skips_the_tower_for_a_repeated_image() {
    feature_cache_skips_the_tower(&GEMMA3);
}

#[test]
fn gemma4_feature_cache_skips_the_tower_for_a_repeated_image() {
    feature_cache_skips_the_tower(&GEMMA4);
}

fn feature_cache_skips_the_tower(vlm: &Vlm) {
    let gw = Gateway::start(&config_for(
        vlm,
        BATCHED_ONLY,
        "{ feature_cache_images: 2 }",
    ));
    // Odd seeds get the second size (Gemma 4: another soft-token count, so
    // a cached image must bring its own count back).
    let url = |seed: u32| {
        let (w, h) = vlm.sizes[(seed % 2) as usize];
        data_url(&encode(&picture(w, h, seed), ImageFormat::Png), "image/png")
    };
    let metric = |name: &str| gw.metric(name, &[]).unwrap_or(0.0) as u64;
    let ask = |seed| {
        tokens(&post_ok(
            &gw,
            &chat_for(vlm, vec![image_part(&url(seed))], 6),
        ))
    };

    let first = ask(0);
    assert_eq!(
        (
            metric("gateway_vision_cache_hits_total"),
            metric("gateway_vision_cache_misses_total")
        ),
        (0, 1)
    );
    // The same tokens; logprobs equal up to the prefix cache's reuse of
    // the first request's KV (a different chunking of the same math).
    let again = ask(0);
    assert_eq!(again.0, first.0, "the cached features gave other tokens");
    close(&again.1, &first.1);
    assert_eq!(
        (
            metric("gateway_vision_cache_hits_total"),
            metric("gateway_vision_cache_misses_total")
        ),
        (1, 1)
    );
    // Two more images push the first out of a cache of two.
    let other = ask(1);
    assert_ne!(other.1, first.1, "another image gave the same logprobs");
    // A cached image of the second size.
    let other_again = ask(1);
    assert_eq!(other_again.0, other.0);
    close(&other_again.1, &other.1);
    ask(2);
    assert_eq!(metric("gateway_vision_cache_images"), 2);
    ask(0);
    assert_eq!(
        (
            metric("gateway_vision_cache_hits_total"),
            metric("gateway_vision_cache_misses_total")
        ),
        (2, 4)
    );
}

#[test]
fn mixed_batch_gives_every_request_its_tokens_alone() {
    let gw = Gateway::start(&config(BATCHED_ONLY, "{}"));
    let bodies: Vec<Value> = vec![
        chat(
            vec![
                json!({"type": "text", "text": "Look:"}),
                image_part(&data_url(
                    &encode(&picture(56, 56, 5), ImageFormat::Png),
                    "image/png",
                )),
            ],
            24,
        ),
        chat(
            vec![json!({"type": "text", "text": "Tell me a story about a cat."})],
            24,
        ),
        chat(
            vec![image_part(&data_url(
                &encode(&picture(90, 70, 6), ImageFormat::Jpeg),
                "image/jpeg",
            ))],
            24,
        ),
        chat(vec![json!({"type": "text", "text": "Count to ten."})], 24),
    ];
    let alone: Vec<_> = bodies.iter().map(|b| tokens(&post_ok(&gw, b))).collect();
    for round in 0..2 {
        let together: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = bodies
                .iter()
                .map(|b| s.spawn(|| tokens(&post_ok(&gw, b))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, ((t_tokens, t_lp), (a_tokens, a_lp))) in together.iter().zip(&alone).enumerate() {
            assert_eq!(
                t_tokens, a_tokens,
                "round {round}: batching changed request {i}'s tokens"
            );
            for (x, y) in t_lp.iter().zip(a_lp) {
                assert!(
                    (x - y).abs() < 1e-3,
                    "round {round}, request {i}: logprobs {t_lp:?} vs {a_lp:?}"
                );
            }
        }
    }
}

#[test]
fn image_tokens_count_against_the_context() {
    let gw = Gateway::start(&config(BATCHED_ONLY, "{}"));
    let text = json!({"type": "text", "text": "Hi"});
    let img = image_part(&data_url(
        &encode(&picture(56, 56, 1), ImageFormat::Png),
        "image/png",
    ));
    let plain = post_ok(&gw, &chat(vec![text.clone()], 2))["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    let with_image = post_ok(&gw, &chat(vec![text.clone(), img.clone()], 2))["usage"]
        ["prompt_tokens"]
        .as_u64()
        .unwrap();
    // 16 soft tokens, <start_of_image>, <end_of_image> and the newlines.
    assert!(with_image >= plain + 18, "{plain} -> {with_image}");
    // The 96-token context holds the text prompt and 60 new tokens, but
    // not once the image's tokens are in the prompt.
    let max = 96 - plain as u32 - 4;
    assert_eq!(
        gw.post("/v1/chat/completions", &chat(vec![text.clone()], max))
            .status,
        200
    );
    let looked_up = |gw: &Gateway| {
        [
            "gateway_vision_cache_hits_total",
            "gateway_vision_cache_misses_total",
        ]
        .map(|m| gw.metric(m, &[]).unwrap_or(0.0) as u64)
    };
    let before = looked_up(&gw);
    let r = gw.post("/v1/chat/completions", &chat(vec![text, img], max));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    // Refused before its image was even looked up.
    assert_eq!(looked_up(&gw), before);
}

#[test]
fn images_are_routed_only_to_engines_that_take_them() {
    images_are_routed_only_to_capable_engines(&GEMMA3);
}

#[test]
fn gemma4_images_are_routed_only_to_engines_that_take_them() {
    images_are_routed_only_to_capable_engines(&GEMMA4);
}

fn images_are_routed_only_to_capable_engines(vlm: &Vlm) {
    let policy = r#"policy:
  default: batched
  fallback: [batched]
  rules:
    - name: sampled-images
      when: { has_images: true, greedy: false }
      route: batched
    - name: greedy-fast
      when: { greedy: true }
      route: fastpath
"#;
    let gw = Gateway::start(&config_for(vlm, policy, "{}"));
    let img = image_part(&data_url(
        &encode(
            &picture(vlm.sizes[0].0, vlm.sizes[0].1, 1),
            ImageFormat::Png,
        ),
        "image/png",
    ));
    let route = |body: &Value| {
        let r = gw.post("/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.text());
        (
            r.header("x-engine").unwrap().to_owned(),
            r.header("x-route-rule").unwrap().to_owned(),
        )
    };
    let text = json!({"model": vlm.name, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(route(&text), ("fastpath".into(), "greedy-fast".into()));
    // Greedy, so `greedy-fast` holds, but its engine takes no images: the
    // rule is passed over and the default decides.
    let mut image = json!({"model": vlm.name, "max_tokens": 3, "messages": [{"role": "user", "content": [img]}]});
    assert_eq!(route(&image), ("batched".into(), "default".into()));
    // `has_images` reaches the policy.
    image["temperature"] = json!(0.7);
    image["seed"] = json!(1);
    assert_eq!(route(&image), ("batched".into(), "sampled-images".into()));
    let mut sampled_text = text.clone();
    sampled_text["temperature"] = json!(0.7);
    assert_eq!(route(&sampled_text), ("batched".into(), "default".into()));
    drop(gw);

    // With nothing to fall back on, the image request is refused rather
    // than sent to the fast path.
    let gw = Gateway::start(&config_for(vlm, "policy: { default: fastpath }", "{}"));
    image["temperature"] = json!(0);
    image.as_object_mut().unwrap().remove("seed");
    let r = gw.post("/v1/chat/completions", &image);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "no_capable_engine");
    assert!(r.text().contains("does not serve requests with images"));
}

#[test]
fn images_from_files_and_http_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = encode(&picture(56, 56, 3), ImageFormat::Png);
    let file = dir.path().join("p.png");
    std::fs::write(&file, &bytes).unwrap();
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    let served = bytes.clone();
    std::thread::spawn(move || {
        for stream in server.incoming().take(2) {
            let mut stream = stream.unwrap();
            let mut buf = [0u8; 2048];
            let _ = stream.read(&mut buf);
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                served.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&served);
        }
    });
    let http_url = format!("http://{addr}/p.png");
    let by_data = {
        let gw = Gateway::start(&config(BATCHED_ONLY, "{}"));
        for (url, code) in [
            (file.display().to_string(), "image_url_not_allowed"),
            (http_url.clone(), "image_url_not_allowed"),
        ] {
            let r = gw.post("/v1/chat/completions", &chat(vec![image_part(&url)], 4));
            assert_eq!(r.status, 400, "{}", r.text());
            assert_eq!(r.json()["error"]["code"], code);
            assert_eq!(
                r.json()["error"]["param"],
                "messages[0].content[0].image_url.url"
            );
        }
        tokens(&post_ok(
            &gw,
            &chat(vec![image_part(&data_url(&bytes, "image/png"))], 4),
        ))
        .0
    };
    let gw = Gateway::start(&config(
        BATCHED_ONLY,
        "{ allow_local_files: true, allow_remote_urls: true, fetch_timeout_s: 1 }",
    ));
    let by_file = tokens(&post_ok(
        &gw,
        &chat(vec![image_part(&format!("file://{}", file.display()))], 4),
    ))
    .0;
    let by_http = tokens(&post_ok(&gw, &chat(vec![image_part(&http_url)], 4))).0;
    assert_eq!(by_file, by_data);
    assert_eq!(by_http, by_data);

    // A server that accepts and never answers runs into fetch_timeout_s.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}/slow.png", silent.local_addr().unwrap());
    let held = std::thread::spawn(move || silent.accept().map(|(stream, _)| stream));
    let started = std::time::Instant::now();
    let r = gw.post(
        "/v1/chat/completions",
        &chat(vec![image_part(&silent_url)], 4),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "image_fetch_failed");
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    drop(held.join());
}

#[test]
fn bad_images_get_clear_400s() {
    let gw = Gateway::start(&config(
        BATCHED_ONLY,
        "{ max_images: 2, max_image_bytes: 60000, max_image_pixels: 250000 }",
    ));
    let png = encode(&picture(56, 56, 1), ImageFormat::Png);
    let noisy = RgbImage::from_fn(200, 200, |x, y| {
        let v = (x.wrapping_mul(2654435761) ^ y.wrapping_mul(40503)).wrapping_mul(2246822519);
        Rgb([v as u8, (v >> 8) as u8, (v >> 16) as u8])
    });
    let cases: Vec<(Vec<Value>, &str, &str)> = vec![
        (
            vec![image_part(&data_url(b"hello, world", "image/png"))],
            "invalid_image",
            "not an image",
        ),
        (
            vec![image_part(&data_url(&png[..png.len() / 2], "image/png"))],
            "invalid_image",
            "truncated",
        ),
        (
            vec![image_part("data:image/png;base64,@@@@")],
            "invalid_image",
            "base64",
        ),
        (
            vec![image_part(&data_url(
                &encode(&noisy, ImageFormat::Png),
                "image/png",
            ))],
            "image_too_large",
            "bytes",
        ),
        (
            vec![image_part(&data_url(
                &encode(&RgbImage::new(600, 500), ImageFormat::Png),
                "image/png",
            ))],
            "image_too_large",
            "pixels",
        ),
        (
            vec![image_part("https://example.com/cat.png")],
            "image_url_not_allowed",
            "remote",
        ),
        (
            vec![image_part("cat.png")],
            "invalid_image",
            "relative path",
        ),
    ];
    for (parts, code, what) in cases {
        let r = gw.post("/v1/chat/completions", &chat(parts, 4));
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let e = r.json()["error"].clone();
        assert_eq!(e["type"], "invalid_request_error", "{what}");
        assert_eq!(e["code"], code, "{what}: {e}");
        assert_eq!(e["param"], "messages[0].content[0].image_url.url", "{what}");
    }
    let img = image_part(&data_url(&png, "image/png"));
    let r = gw.post(
        "/v1/chat/completions",
        &chat(vec![img.clone(), img.clone(), img.clone()], 4),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "too_many_images");
    // Typed image markers cannot smuggle in an image.
    let r = gw.post(
        "/v1/chat/completions",
        &chat(
            vec![
                json!({"type": "text", "text": "<start_of_image>"}),
                img.clone(),
            ],
            4,
        ),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_image");
    // The server still serves.
    post_ok(&gw, &chat(vec![img], 4));
}

#[test]
fn bidirectional_image_attention_keeps_each_image_in_one_prefill_chunk() {
    let img = image_part(&data_url(
        &encode(&picture(56, 56, 4), ImageFormat::Png),
        "image/png",
    ));
    let body = chat(
        vec![json!({"type": "text", "text": "Look at this"}), img],
        8,
    );
    let run = |batched: &str, attention: &str| {
        let cfg = config(BATCHED_ONLY, &format!("{{ image_attention: {attention} }}"))
            .replace("batched: { kind: batched }", batched);
        let gw = Gateway::start(&cfg);
        tokens(&post_ok(&gw, &body))
    };
    let whole = run("batched: { kind: batched }", "bidirectional");
    // Chunks of 5 would cut the 16 image tokens; the engine extends them.
    let chunked = run(
        "batched: { kind: batched, prefill_chunk: 5 }",
        "bidirectional",
    );
    let causal = run("batched: { kind: batched, prefill_chunk: 5 }", "causal");
    assert_eq!(chunked.0, whole.0);
    close(&chunked.1, &whole.1);
    assert_ne!(causal.1, whole.1, "bidirectional attention changed nothing");
}

#[test]
fn image_requests_stream() {
    let gw = Gateway::start(&config(BATCHED_ONLY, "{}"));
    let img = image_part(&data_url(
        &encode(&picture(70, 40, 8), ImageFormat::Jpeg),
        "image/jpeg",
    ));
    let mut body = chat(vec![json!({"type": "text", "text": "Hi"}), img], 10);
    body.as_object_mut().unwrap().remove("logprobs");
    let whole = post_ok(&gw, &body)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    body["stream"] = json!(true);
    let events = gw.post("/v1/chat/completions", &body).sse_data();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = e2e_tests::http::json_chunks(&events)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, whole);
}

/// Gemma 4's `use_bidirectional_attention: vision` turns bidirectional image
/// attention on by itself; `vision.image_attention` overrides it.
#[test]
fn gemma4_config_turns_on_bidirectional_image_attention() {
    let vlm = Vlm {
        name: "tiny-gemma4-vision-bidi",
        path: models::tiny_gemma4_vision_bidirectional,
        ..GEMMA4
    };
    let (w, h) = vlm.sizes[0];
    let img = image_part(&data_url(
        &encode(&picture(w, h, 4), ImageFormat::Png),
        "image/png",
    ));
    let body = chat_for(
        &vlm,
        vec![json!({"type": "text", "text": "Look at this"}), img],
        8,
    );
    let run = |batched: &str, vision: &str| {
        let cfg =
            config_for(&vlm, BATCHED_ONLY, vision).replace("batched: { kind: batched }", batched);
        let gw = Gateway::start(&cfg);
        tokens(&post_ok(&gw, &body))
    };
    let chunk5 = "batched: { kind: batched, prefill_chunk: 5 }";
    let by_config = run("batched: { kind: batched }", "{}");
    let bidirectional = run(chunk5, "{ image_attention: bidirectional }");
    let causal = run(chunk5, "{ image_attention: causal }");
    assert_eq!(by_config.0, bidirectional.0);
    close(&by_config.1, &bidirectional.1);
    assert_ne!(
        causal.1, by_config.1,
        "the config's bidirectional attention changed nothing"
    );
}
