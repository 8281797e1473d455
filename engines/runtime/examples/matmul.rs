use mlx_rs::{Array, Dtype};
fn main() {
    println!("{}", mlx_sys::blas_backend());
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let b = a.matmul(&a).unwrap();
    println!("{:?}", b.as_slice::<f32>());
    let c = b.as_dtype(Dtype::Bfloat16).unwrap();
    println!("{:?}", c.as_slice::<half::bf16>());
    println!("{:?}", c.sum(None).unwrap().item::<half::bf16>());
    println!(
        "{:?}",
        c.as_dtype(Dtype::Float16)
            .unwrap()
            .sum(None)
            .unwrap()
            .item::<half::f16>()
    );
}
