//! A paged KV cache ([`runtime::paged`]) computes what the contiguous one
//! does: greedy tokens equal and logits within fp32 rounding, through a
//! padded batch's prefill and decode, stacking, letting rows go, per-row
//! rollback and row views that write (copy on write), on every family's
//! cache layout (sliding windows, KV-shared layers, recurrent layers, a
//! quantized KV cache). Every block goes back to the pool at the end.

use fixtures::gemma4::Gemma4Shape;
use fixtures::model::{random_prompt, write_model, TinySpec};
use fixtures::qwen::QwenShape;
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::generate::{argmax_tokens, greedy_batch_in, left_padded};
use runtime::model::Logits;
use runtime::paged::PagePool;
use runtime::{Family, KvCache, KvQuant, LoadedModel, Model};

fn values(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap();
    eval([&a]).unwrap();
    a.as_slice::<f32>().to_vec()
}

fn tokens(logits: &Array) -> Vec<i32> {
    let t = argmax_tokens(logits).unwrap();
    eval([&t]).unwrap();
    t.as_slice::<i32>().to_vec()
}

fn column(t: &[i32]) -> Array {
    Array::from_slice(t, &[t.len() as i32, 1])
}

fn models() -> Vec<(&'static str, tempfile::TempDir, Option<KvQuant>)> {
    let specs = [
        ("qwen3", TinySpec::tiny(Family::Qwen3), None),
        (
            "qwen3, 8-bit KV",
            wide_heads(),
            Some(KvQuant {
                bits: 8,
                group_size: 32,
            }),
        ),
        // Sliding-window layers, contexts past the window.
        ("gemma3", TinySpec::tiny(Family::Gemma3), None),
        // KV-shared layers.
        ("gemma4 e2b", TinySpec::gemma4(Gemma4Shape::e2b(6)), None),
        // Recurrent layers beside attention ones.
        ("qwen3.5", TinySpec::qwen(QwenShape::qwen35()), None),
    ];
    specs
        .into_iter()
        .map(|(name, spec, kv)| {
            let dir = tempfile::tempdir().unwrap();
            write_model(dir.path(), &spec).unwrap();
            (name, dir, kv)
        })
        .collect()
}

/// Heads wide enough for a quantized KV cache's groups.
fn wide_heads() -> TinySpec {
    let mut spec = TinySpec::tiny(Family::Qwen3);
    spec.head_dim = 32;
    spec
}

fn load(dir: &tempfile::TempDir, kv: Option<KvQuant>) -> LoadedModel {
    let mut model = LoadedModel::load(dir.path(), None).unwrap();
    model.model.set_kv_quant(kv).unwrap();
    model
}

/// A pool of 16-position blocks for `m`, handed out in a scrambled order.
fn pool(m: &Model) -> PagePool {
    let pool = PagePool::new(m.config.num_layers as usize, 200, 16).unwrap();
    let mut all: Vec<_> = (0..200).map(|_| Some(pool.allocate().unwrap())).collect();
    for i in (0..200).map(|i| (i * 37) % 200) {
        all[i] = None;
    }
    pool
}

#[test]
fn a_paged_batch_decodes_the_contiguous_batchs_tokens() {
    for (name, dir, kv) in models() {
        let model = load(&dir, kv);
        let m = &model.model;
        let pool = pool(m);
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| random_prompt(i, 5 + 13 * i as usize, 500))
            .collect();
        let contiguous = greedy_batch_in(m, None, &prompts, 40, &[]).unwrap();
        let paged = greedy_batch_in(m, Some(&pool), &prompts, 40, &[]).unwrap();
        assert_eq!(paged, contiguous, "{name}");
        assert_eq!(pool.free_blocks(), pool.usable(), "{name}: blocks leaked");
    }
}

/// Runs the same batch operations on a contiguous and a paged cache and
/// compares every step's logits.
struct Twin<'a> {
    m: &'a Model,
    caches: [KvCache; 2],
    worst: f32,
}

impl Twin<'_> {
    fn step(&mut self, next: &[i32]) -> Vec<i32> {
        let ids = column(next);
        let out: Vec<Array> = self
            .caches
            .iter_mut()
            .map(|c| self.m.forward(&ids, c, Logits::Last).unwrap())
            .collect();
        self.compare(&out);
        let (ta, tb) = (tokens(&out[0]), tokens(&out[1]));
        assert_eq!(ta, tb, "greedy tokens");
        ta
    }

    fn compare(&mut self, out: &[Array]) {
        let (a, b) = (values(&out[0]), values(&out[1]));
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        self.worst = self.worst.max(worst);
    }

    fn each(&mut self, f: impl Fn(&mut KvCache)) {
        self.caches.iter_mut().for_each(f);
    }
}

#[test]
fn batch_operations_on_a_paged_cache_match_the_contiguous_ones() {
    for (name, dir, kv) in models() {
        let model = load(&dir, kv);
        let m = &model.model;
        let pool = pool(m);
        // Two sequences prefilled on their own, stacked, decoded together.
        let prefill = |prompt: &[u32], paged: bool| {
            let (ids, pads) = left_padded(std::iter::once(prompt), 0);
            let mut c = match paged {
                true => m.new_paged_cache(&pool, pads),
                false => m.new_padded_cache(pads),
            };
            c.keep_steps(true);
            let logits = m.forward(&ids, &mut c, Logits::Last).unwrap();
            (c, logits)
        };
        let (p1, p2) = (random_prompt(1, 21, 500), random_prompt(2, 40, 500));
        let mut twin = Twin {
            m,
            caches: [KvCache::new(0, 0), KvCache::new(0, 0)],
            worst: 0.0,
        };
        let mut parts = Vec::new();
        let mut first = Vec::new();
        for paged in [false, true] {
            let (c1, l1) = prefill(&p1, paged);
            let (c2, l2) = prefill(&p2, paged);
            first.push((l1, l2));
            parts.push(KvCache::merge(vec![c1, c2]).unwrap());
        }
        let [contiguous, paged]: [KvCache; 2] = parts.try_into().ok().unwrap();
        assert!(paged.page_pool().is_some());
        twin.caches = [contiguous, paged];
        let mut next: Vec<i32> = [&first[0].0, &first[0].1]
            .iter()
            .map(|l| tokens(l)[0])
            .collect();
        for _ in 0..20 {
            next = twin.step(&next);
        }
        // A verify-like forward of 4 positions per row, then each row
        // keeps its own count (per-row rollback).
        let block: Vec<i32> = next
            .iter()
            .flat_map(|&t| [t, t + 1, t + 2, t + 3])
            .collect();
        let ids = Array::from_slice(&block, &[2, 4]);
        let out: Vec<Array> = twin
            .caches
            .iter_mut()
            .map(|c| m.forward(&ids, c, Logits::All).unwrap())
            .collect();
        twin.compare(&out);
        twin.each(|c| c.truncate_rows(&[3, 1]).unwrap());
        assert_eq!(twin.caches[0].left_padding(), twin.caches[1].left_padding());
        for _ in 0..10 {
            next = twin.step(&next);
        }
        // A row's view and the batch both write on into the block they
        // share: each copies it first, neither sees the other's tokens
        // (the batch's side is checked by its logits below).
        let mut view = twin.caches[1].row_view(1).unwrap();
        for t in 0..20 {
            m.forward(&column(&[t]), &mut view, Logits::Last).unwrap();
        }
        let mine = view.layer_kv(0).unwrap().map(|(k, _)| values(&k));
        for _ in 0..3 {
            next = twin.step(&next);
        }
        let after = view.layer_kv(0).unwrap().map(|(k, _)| values(&k));
        assert_eq!(mine, after, "{name}: the batch's writes reached a view");
        drop(view);
        // A row leaves; the other goes on alone, then a new one joins.
        twin.each(|c| c.select_rows(&[1]).unwrap());
        for _ in 0..5 {
            next = twin.step(&next[1..]);
            next.insert(0, 0);
        }
        let (c3, l3) = prefill(&random_prompt(3, 9, 500), false);
        let joined = [
            KvCache::merge(vec![twin.caches[0].clone(), c3.clone()]).unwrap(),
            KvCache::merge(vec![twin.caches[1].clone(), c3.into_paged(&pool).unwrap()]).unwrap(),
        ];
        twin.caches = joined;
        next = vec![next[1], tokens(&l3)[0]];
        for _ in 0..10 {
            next = twin.step(&next);
        }
        // A row taken out (its blocks shared) is the contiguous cache's row.
        let rows = [
            twin.caches[0].extract_row(1).unwrap(),
            twin.caches[1].extract_row(1).unwrap(),
        ];
        assert!(rows[1].page_pool().is_some());
        for l in 0..m.config.num_layers as usize {
            let kv = rows.iter().map(|r| {
                r.layer_kv(l)
                    .unwrap()
                    .map(|(k, v)| (values(&k), values(&v)))
            });
            let [a, b]: [_; 2] = kv.collect::<Vec<_>>().try_into().ok().unwrap();
            assert_eq!(a.is_some(), b.is_some(), "{name} layer {l}");
            if let (Some(a), Some(b)) = (a, b) {
                let worst = a.0.iter().chain(&a.1).zip(b.0.iter().chain(&b.1));
                let worst = worst.map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                assert!(
                    a.0.len() == b.0.len() && worst < 1e-4,
                    "{name} layer {l}: the extracted row differs by {worst}"
                );
            }
        }
        assert!(twin.worst < 1e-4, "{name}: logits off by {}", twin.worst);
        drop((twin, rows));
        assert_eq!(pool.free_blocks(), pool.usable(), "{name}: blocks leaked");
    }
}

/// A prompt prefilled alone but padded (a group's repeating width on a
/// GPU) joins a paged batch without its padding, and decodes what the
/// padded contiguous row does.
#[test]
fn a_lone_padded_row_joins_a_paged_batch_without_its_padding() {
    for (name, dir, kv) in models() {
        let model = load(&dir, kv);
        let m = &model.model;
        let pool = pool(m);
        let prompt = random_prompt(4, 11, 500);
        let (ids, pads) = left_padded(std::iter::once(prompt.as_slice()), 16);
        let mut caches = [
            m.new_padded_cache(pads.clone()),
            m.new_paged_cache(&pool, pads),
        ];
        let first = tokens(&m.forward(&ids, &mut caches[0], Logits::Last).unwrap());
        m.forward(&ids, &mut caches[1], Logits::Last).unwrap();
        let [contiguous, paged] = caches;
        let contiguous = KvCache::join(None, contiguous).unwrap();
        let paged = KvCache::join(None, paged).unwrap();
        assert_eq!(contiguous.left_padding(), &[5], "{name}");
        assert_eq!(paged.left_padding(), &[0], "{name}");
        assert_eq!(paged.len(), prompt.len() as i32, "{name}");
        let mut twin = Twin {
            m,
            caches: [contiguous, paged],
            worst: 0.0,
        };
        let mut next = first;
        for _ in 0..20 {
            next = twin.step(&next);
        }
        assert!(twin.worst < 1e-4, "{name}: logits off by {}", twin.worst);
        drop(twin);
        assert_eq!(pool.free_blocks(), pool.usable(), "{name}: blocks leaked");
    }
}

/// Keys and values handed to a paged cache as the pool's rows
/// (`update_rows`, the GPU's fused heads' layout) are written where
/// `update` writes the same positions as `[B, heads, n, D]`: a padded
/// batch's prefill and then single-position steps read back equal.
#[test]
fn keys_given_as_the_pools_rows_are_written_where_heads_are() {
    let (heads, dim) = (2, 8);
    let left_pad = vec![0, 5, 2];
    let rows = left_pad.len() as i32;
    let new_pool = || PagePool::new(1, 40, 16).unwrap();
    let (by_heads, by_rows) = (new_pool(), new_pool());
    let mut a = KvCache::paged(&by_heads, vec![None], left_pad.clone());
    let mut b = KvCache::paged(&by_rows, vec![None], left_pad.clone());
    assert!(b.takes_rows(0));
    let mut seed = 0u64;
    for n in [21, 1, 1, 3] {
        seed += 1;
        let key = mlx_rs::random::key(seed).unwrap();
        let k = mlx_rs::random::normal::<f32>(&[rows, heads, n, dim], None, None, &key).unwrap();
        let v = k.multiply(Array::from_f32(-2.0)).unwrap();
        // [B, H, n, D] -> [B * n, 1, H, D]
        let as_rows = |x: &Array| {
            x.transpose_axes(&[0, 2, 1, 3])
                .unwrap()
                .reshape(&[rows * n, 1, heads, dim])
                .unwrap()
        };
        let want = a.update(0, k.clone(), v.clone()).unwrap().dense().unwrap();
        let got = b
            .update_rows(0, as_rows(&k), as_rows(&v), n)
            .unwrap()
            .dense()
            .unwrap();
        a.advance(n);
        b.advance(n);
        // Padding columns come from block 0, which both pools fill with
        // whatever padding was written; only real columns are compared.
        let real = |x: &Array| {
            let total = x.dim(2);
            (0..rows as usize)
                .flat_map(|r| {
                    let start = left_pad[r] as i32;
                    let row = values(
                        &x.take_axis(Array::from_slice(&[r as i32], &[1]), 0)
                            .unwrap()
                            .transpose_axes(&[0, 2, 1, 3])
                            .unwrap(),
                    );
                    let per = (heads * dim) as usize;
                    row[start as usize * per..total as usize * per].to_vec()
                })
                .collect::<Vec<f32>>()
        };
        assert_eq!(real(&got.0), real(&want.0), "keys after {n} columns");
        assert_eq!(real(&got.1), real(&want.1), "values after {n} columns");
    }
    let contiguous = KvCache::new(1, 1);
    assert!(!contiguous.takes_rows(0), "a contiguous cache takes heads");
}
