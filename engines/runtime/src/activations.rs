//! Gated activations as compiled (fused) element-wise kernels, like
//! mlx-lm's `swiglu`: one kernel launch instead of three per layer and
//! token, which is most of what decode costs beyond the matmuls on a GPU.

use std::cell::RefCell;
use std::thread::LocalKey;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{nn, ops, Array};

/// A compiled function, kept per thread in a `thread_local!` (the compile
/// cache is keyed by function, so it is traced once per thread and shape).
pub(crate) type Fused = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

/// Calls the compiled function `kernel` holds.
pub(crate) fn call(
    kernel: &'static LocalKey<RefCell<Fused>>,
    args: &[Array],
) -> Result<Vec<Array>, Exception> {
    kernel.with(|f| (f.borrow_mut())(args))
}

fn swiglu(args: &[Array]) -> Vec<Array> {
    let act = nn::silu(&args[0]).expect("silu of a float array");
    vec![act.multiply(&args[1]).expect("same-shape product")]
}

fn geglu(args: &[Array]) -> Vec<Array> {
    let act = gelu_approx(&args[0]).expect("gelu of a float array");
    vec![act.multiply(&args[1]).expect("same-shape product")]
}

/// Tanh-approximated GELU, `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715
/// * x^3)))`, as MLX's Python `nn.gelu_approx` computes it, in `x`'s dtype.
/// mlx-rs's `gelu_approximate` multiplies by float32 constants, and C++ MLX
/// has no weak scalars: a bf16 activation came out float32 and carried
/// float32 through the rest of the model (every quantized matmul after it
/// then cast its scales and biases to float32 on every step).
pub fn gelu_approx(x: &Array) -> Result<Array, Exception> {
    let c = |v: f64| Array::from_f32(v as f32).as_dtype(x.dtype());
    let cubic = c(0.044715)?.multiply(x.power(c(3.0)?)?)?;
    let inner = c((2.0 / std::f64::consts::PI).sqrt())?.multiply(x.add(cubic)?)?;
    c(0.5)?
        .multiply(x)?
        .multiply(c(1.0)?.add(ops::tanh(&inner)?)?)
}

thread_local! {
    // Compiled once per thread; the compile cache is keyed by function.
    static SWIGLU: RefCell<Fused> = RefCell::new(Box::new(compile(swiglu, true)));
    static GEGLU: RefCell<Fused> = RefCell::new(Box::new(compile(geglu, true)));
}

/// `act(gate) * up`, with SiLU (Llama, Qwen) or tanh-approximated GELU (Gemma).
pub fn gated(gate: &Array, up: &Array, gelu: bool) -> Result<Array, Exception> {
    let kernel = if gelu { &GEGLU } else { &SWIGLU };
    Ok(call(kernel, &[gate.clone(), up.clone()])?.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;

    #[test]
    fn geglu_keeps_half_precision_and_matches_the_formula() {
        let x = Array::from_slice(&[-3.0f32, -0.5, 0.0, 0.7, 2.5], &[5]);
        let up = Array::from_slice(&[1.0f32, 2.0, -1.0, 0.5, 3.0], &[5]);
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            let (x, up) = (x.as_dtype(dtype).unwrap(), up.as_dtype(dtype).unwrap());
            assert_eq!(gelu_approx(&x).unwrap().dtype(), dtype);
            assert_eq!(gated(&x, &up, true).unwrap().dtype(), dtype);
        }
        let got = gelu_approx(&x).unwrap();
        let want: Vec<f32> = x
            .as_slice::<f32>()
            .iter()
            .map(|&v| {
                let v = v as f64;
                let t = ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh();
                (0.5 * v * (1.0 + t)) as f32
            })
            .collect();
        for (g, w) in got.as_slice::<f32>().iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }
}
