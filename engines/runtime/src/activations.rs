//! Gated activations as compiled (fused) element-wise kernels, like
//! mlx-lm's `swiglu`: one kernel launch instead of three per layer and
//! token, which is most of what decode costs beyond the matmuls on a GPU.

use std::cell::RefCell;
use std::thread::LocalKey;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{nn, Array};

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
    let act = nn::gelu_approximate(&args[0]).expect("gelu of a float array");
    vec![act.multiply(&args[1]).expect("same-shape product")]
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
