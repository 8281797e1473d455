//! One paged pool for the whole server, seen through its C table as a
//! plugin sees it: a prefix-cache entry keeps the blocks of the sequence
//! that computed it (no copy), a hit takes the entry's blocks (no copy) and
//! writes its continuation into new ones, leaving the entry's untouched;
//! the continuation's logits equal a contiguous cache's. When the entry
//! gives way, every block is back.

use fixtures::model::{random_prompt, write_model, TinySpec};
use mlx_rs::transforms::eval;
use mlx_rs::{Array, Dtype};
use runtime::abi;
use runtime::generate::tokens_array;
use runtime::model::Logits;
use runtime::paged::PagePool;
use runtime::prefix_cache::SharedPrefixCache;
use runtime::{Family, KvCache, KvPool, LoadedModel, Model};

fn values(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap();
    eval([&a]).unwrap();
    a.as_slice::<f32>().to_vec()
}

fn forward(m: &Model, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    values(
        &m.forward(&tokens_array(tokens), cache, Logits::All)
            .unwrap(),
    )
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn prefix_hits_share_the_pools_blocks_across_the_c_boundary() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &TinySpec::tiny(Family::Qwen3)).unwrap();
    let model = LoadedModel::load(dir.path(), None).unwrap();
    let m = &model.model;
    let ledger = KvPool::new(64, 16, 1024);
    // The host's pool and prefix cache, and a plugin's views of them.
    let host_pool = PagePool::new(m.num_layers(), ledger.total(), 16).unwrap();
    let host_store = SharedPrefixCache::new(&ledger, 8, false, Some(&host_pool));
    let pool = unsafe { abi::foreign::pages(&abi::export::pages(&host_pool)) };
    let store =
        unsafe { abi::foreign::prefix_cache(&abi::export::prefix_cache(&host_store), Some(&pool)) };
    let held = || pool.usable() - pool.free_blocks();

    let prompt = random_prompt(3, 40, 500);
    let mut cache = m.new_paged_cache(&pool, vec![0]);
    forward(m, &mut cache, &prompt);
    assert_eq!(held(), 3, "40 positions in 16-position blocks");
    store.insert(None, &prompt, &cache);
    assert_eq!(held(), 3, "the entry shares the sequence's blocks");
    drop(cache);
    assert_eq!(held(), 2, "the entry keeps its 32 positions' blocks");
    assert_eq!(ledger.cached(), 2);

    // A prompt extending the entry's 32 tokens.
    let extended: Vec<u32> = prompt[..32]
        .iter()
        .copied()
        .chain(random_prompt(4, 12, 500))
        .collect();
    let hit = store.lookup(None, &extended, m.num_layers()).unwrap();
    assert_eq!((hit.tokens, hit.cache.len()), (32, 32));
    assert!(hit.cache.page_pool().is_some_and(|p| p.same(&pool)));
    assert_eq!(held(), 2, "the hit shares the entry's blocks");
    let mut continued = hit.cache;
    let got = forward(m, &mut continued, &extended[32..]);
    assert_eq!(held(), 3, "the continuation writes one new block");

    let mut reference = m.new_cache(1);
    let want = forward(m, &mut reference, &extended);
    let tail = &want[want.len() - got.len()..];
    assert!(worst(&got, tail) < 1e-4, "{}", worst(&got, tail));

    // The entry's blocks were not written: a second hit continues the same.
    let mut again = store.lookup(None, &extended, m.num_layers()).unwrap().cache;
    let got_again = forward(m, &mut again, &extended[32..]);
    assert_eq!(got_again, got);
    drop((continued, again));
    assert_eq!(held(), 2);

    // A sequence wanting every block has the entry give way.
    drop(ledger.try_reserve(ledger.total()).unwrap());
    assert_eq!(held(), 0, "every block is back");
}
