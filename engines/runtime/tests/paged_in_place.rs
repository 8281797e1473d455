//! A write into a paged pool updates the layer's buffers in place: MLX
//! gets the only handle to the old buffers and reuses their memory, so a
//! decode step never copies a layer of the pool, whether it writes one
//! row's position (a slice) or several rows' (a scatter). Its own test binary, so
//! no other test's arrays move MLX's peak memory meanwhile.

use mlx_rs::Array;
use runtime::memory::{mlx_memory, reset_peak};
use runtime::paged::PagePool;
use runtime::KvCache;

#[test]
fn writes_into_the_pool_copy_no_layer() {
    // One layer of 4096 blocks of 16 positions, 8 heads of 128 floats:
    // 256 MiB for the keys and as much for the values.
    let pool = PagePool::new(1, 4095, 16).unwrap();
    for rows in [1, 2] {
        let mut cache = KvCache::paged(&pool, vec![None], vec![0; rows]);
        let token = || Array::from_slice(&vec![0.5f32; rows * 8 * 128], &[rows as i32, 8, 1, 128]);
        cache.update(0, token(), token()).unwrap();
        cache.advance(1);
        mlx_rs::transforms::eval(&cache.state()).unwrap();
        let layer = pool.nbytes() as u64;
        assert_eq!(layer, 2 * 4096 * 16 * 8 * 128 * 4);
        reset_peak();
        let before = mlx_memory().active;
        for _ in 0..8 {
            cache.update(0, token(), token()).unwrap();
            cache.advance(1);
            mlx_rs::transforms::eval(&cache.state()).unwrap();
        }
        let grown = mlx_memory().peak.saturating_sub(before);
        // A copy of either buffer would take 256 MiB more at its peak.
        assert!(
            grown < layer / 8,
            "{rows} row(s): writes took {grown} more bytes at their peak"
        );
        assert_eq!(cache.len(), 9);
    }
}
