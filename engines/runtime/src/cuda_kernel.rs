//! MLX custom CUDA kernels (mlx-c's `mlx_fast_cuda_kernel_*`): a kernel
//! body compiled by MLX on first use, once per template instance, and run
//! inside the MLX graph like any other op.

use std::ffi::CString;

use anyhow::anyhow;
use mlx_rs::{Array, Dtype};

/// A template argument of one launch.
#[derive(Clone, Copy)]
pub enum TemplateArg<'a> {
    Dtype(&'a str, Dtype),
    Int(&'a str, i32),
}

/// One launch: each output's shape and dtype, the grid in threads (MLX
/// divides it by the block), the block, the template arguments, and a
/// value MLX fills every output with before the kernel runs (`None`: the
/// outputs start uninitialised).
pub struct Launch<'a> {
    pub outputs: &'a [(&'a [i32], Dtype)],
    pub grid_threads: i32,
    pub block_threads: i32,
    pub templates: &'a [TemplateArg<'a>],
    pub init: Option<f32>,
}

pub struct CudaKernel {
    raw: mlx_sys::mlx_fast_cuda_kernel,
}

impl CudaKernel {
    /// `source` is the kernel's body; it reads its `inputs` and writes its
    /// `outputs` by these names (MLX adds `<name>_shape` and
    /// `<name>_strides` for those the body uses); `header` goes before the
    /// kernel (device functions). With `contiguous`, MLX copies inputs that
    /// are not row-contiguous first.
    pub fn new(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        contiguous: bool,
    ) -> anyhow::Result<Self> {
        Self::with_shared_memory(name, inputs, outputs, source, header, contiguous, 0)
    }

    /// [`CudaKernel::new`] of a kernel that declares `extern __shared__`
    /// memory: every launch gets `shared_memory` bytes of it (MLX raises
    /// the kernel's limit beyond 48 KB).
    pub fn with_shared_memory(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        contiguous: bool,
        shared_memory: i32,
    ) -> anyhow::Result<Self> {
        let names = |list: &[&str]| -> anyhow::Result<mlx_sys::mlx_vector_string> {
            let owned = list
                .iter()
                .map(|s| CString::new(*s))
                .collect::<Result<Vec<_>, _>>()?;
            let ptrs: Vec<*const std::os::raw::c_char> = owned.iter().map(|s| s.as_ptr()).collect();
            Ok(unsafe { mlx_sys::mlx_vector_string_new_data(ptrs.as_ptr() as *mut _, ptrs.len()) })
        };
        let inputs = names(inputs)?;
        let outputs = names(outputs)?;
        let c_name = CString::new(name)?;
        let source = CString::new(source)?;
        let header = CString::new(header)?;
        let raw = unsafe {
            let raw = mlx_sys::mlx_fast_cuda_kernel_new(
                c_name.as_ptr(),
                inputs,
                outputs,
                source.as_ptr(),
                header.as_ptr(),
                contiguous,
                shared_memory,
            );
            mlx_sys::mlx_vector_string_free(inputs);
            mlx_sys::mlx_vector_string_free(outputs);
            raw
        };
        if raw.ctx.is_null() {
            return Err(anyhow!("MLX refused the {name} kernel"));
        }
        Ok(Self { raw })
    }

    /// Adds one launch of the kernel over `inputs` to the graph on this
    /// thread's stream; returns its outputs. `None` when MLX refused it.
    pub fn apply(&self, inputs: &[&Array], launch: &Launch) -> Option<Vec<Array>> {
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut ok = launch.outputs.iter().all(|(shape, dtype)| {
                mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    shape.as_ptr(),
                    shape.len(),
                    *dtype as mlx_sys::mlx_dtype,
                ) == 0
            }) && mlx_sys::mlx_fast_cuda_kernel_config_set_grid(
                config,
                launch.grid_threads,
                1,
                1,
            ) == 0
                && mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                    config,
                    launch.block_threads,
                    1,
                    1,
                ) == 0
                && launch.init.is_none_or(|value| {
                    mlx_sys::mlx_fast_cuda_kernel_config_set_init_value(config, value) == 0
                });
            for t in launch.templates {
                ok = ok
                    && match t {
                        TemplateArg::Dtype(name, dtype) => {
                            let name = CString::new(*name).unwrap_or_default();
                            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                                config,
                                name.as_ptr(),
                                *dtype as mlx_sys::mlx_dtype,
                            ) == 0
                        }
                        TemplateArg::Int(name, value) => {
                            let name = CString::new(*name).unwrap_or_default();
                            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                                config,
                                name.as_ptr(),
                                *value,
                            ) == 0
                        }
                    };
            }
            let vin = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(vin, a.as_ptr());
            }
            let mut vout = mlx_sys::mlx_vector_array_new();
            let stream = mlx_rs::Stream::thread_local_or_default();
            let applied = ok
                && mlx_sys::mlx_fast_cuda_kernel_apply(
                    &mut vout,
                    self.raw,
                    vin,
                    config,
                    stream.as_ptr(),
                ) == 0;
            let mut outs = Vec::with_capacity(launch.outputs.len());
            if applied {
                for i in 0..launch.outputs.len() {
                    let mut out = mlx_sys::mlx_array_new();
                    if mlx_sys::mlx_vector_array_get(&mut out, vout, i) != 0 {
                        mlx_sys::mlx_array_free(out);
                        break;
                    }
                    outs.push(Array::from_ptr(out));
                }
            }
            mlx_sys::mlx_vector_array_free(vin);
            mlx_sys::mlx_vector_array_free(vout);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            (outs.len() == launch.outputs.len()).then_some(outs)
        }
    }
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.raw) };
    }
}
