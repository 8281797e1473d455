//! Nodes and host time per step, per shape. For each shape (a decode step
//! of B rows, a verify of W tokens of one row, a prefill chunk of P tokens)
//! it builds the step's graph over a cache at `--context` positions, counts
//! the operations MLX will run (`mlx_sys::graph_nodes`) and times, over
//! `--steps` steps: building the graph on the host, launching it
//! (`async_eval`: MLX encodes its kernels on the calling thread) and
//! waiting for the result. On a GPU a small model's step is set by the
//! host's time per node, so fewer nodes is the lever this measures.
//!
//!     cargo run --release -p runtime --example step_probe -- --model DIR \
//!         [--context 128] [--steps 32] [--rows 1,16,64] [--verify 2,8] \
//!         [--prefill 256] [--paged] [--histogram] [--masked]
//!
//! The engines under config.yaml keep contiguous KV (`kv_layout:
//! contiguous`), which is what this measures without `--paged`; a verify of
//! k drafts is `--verify k+1` (the newest token and the drafts). The first
//! line names the path: the KV layout, whether the fused CPU nodes run and
//! the packed products' instruction set. Build the example with the tree
//! it measures: a stale binary times the kernels it was built with.
//!
//! `--histogram` also prints each shape's operations by primitive;
//! `--masked` gives attention mask arrays and MLX's kernels instead of the
//! ragged kernel (a paged single row then reads a gathered copy).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;
use runtime::cache::KvCache;
use runtime::generate;
use runtime::model::{Logits, Model};
use runtime::paged::PagePool;
use runtime::{ComputeDtype, LoadedModel};

struct Args {
    model: PathBuf,
    context: usize,
    steps: usize,
    rows: Vec<usize>,
    verify: Vec<usize>,
    prefill: Vec<usize>,
    paged: bool,
    histogram: bool,
    masked: bool,
}

fn list(v: &str) -> anyhow::Result<Vec<usize>> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().with_context(|| format!("not a number: {s}")))
        .collect()
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        model: PathBuf::new(),
        context: 128,
        steps: 32,
        rows: vec![1, 16, 64],
        verify: vec![2, 8],
        prefill: vec![256],
        paged: false,
        histogram: false,
        masked: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--paged" => a.paged = true,
            "--histogram" => a.histogram = true,
            "--masked" => a.masked = true,
            _ => {
                let v = it.next().ok_or_else(|| anyhow!("{flag} needs a value"))?;
                match flag.as_str() {
                    "--model" => a.model = PathBuf::from(v),
                    "--context" => a.context = v.parse()?,
                    "--steps" => a.steps = v.parse()?,
                    "--rows" => a.rows = list(&v)?,
                    "--verify" => a.verify = list(&v)?,
                    "--prefill" => a.prefill = list(&v)?,
                    _ => anyhow::bail!("unknown flag {flag}"),
                }
            }
        }
    }
    anyhow::ensure!(!a.model.as_os_str().is_empty(), "--model DIR is required");
    Ok(a)
}

/// One shape's figures: nodes of its graph, and mean host and device
/// phases per step.
struct Probe {
    nodes: usize,
    by_name: Vec<(String, usize)>,
    built: Duration,
    launched: Duration,
    waited: Duration,
}

/// Runs `steps` steps of `step` (which builds one step's graph and returns
/// its output), each evaluated before the next; counts the first's nodes.
fn probe(
    steps: usize,
    mut step: impl FnMut() -> anyhow::Result<Array>,
    mut after: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Probe> {
    let mut p = Probe {
        nodes: 0,
        by_name: Vec::new(),
        built: Duration::ZERO,
        launched: Duration::ZERO,
        waited: Duration::ZERO,
    };
    // One unmeasured step builds the shape's kernels.
    eval([&step()?])?;
    after()?;
    for i in 0..steps {
        let t = Instant::now();
        let out = step()?;
        p.built += t.elapsed();
        if i == 0 {
            let (nodes, by_name) = unsafe { mlx_sys::graph_nodes(&[out.as_ptr()]) }
                .ok_or_else(|| anyhow!("graph counting is not built here"))?;
            (p.nodes, p.by_name) = (nodes, by_name);
        }
        let t = Instant::now();
        async_eval([&out])?;
        p.launched += t.elapsed();
        let t = Instant::now();
        eval([&out])?;
        p.waited += t.elapsed();
        after()?;
    }
    let n = steps.max(1) as u32;
    (p.built, p.launched, p.waited) = (p.built / n, p.launched / n, p.waited / n);
    Ok(p)
}

/// A cache of `rows` rows holding `context` prompt positions each.
fn filled(
    model: &Model,
    pool: Option<&PagePool>,
    rows: usize,
    context: usize,
) -> anyhow::Result<KvCache> {
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % 1000)
        .collect();
    let prompts = vec![prompt; rows];
    let (ids, pads) = generate::left_padded(prompts.iter().map(Vec::as_slice), 0);
    let mut cache = match pool {
        Some(pool) => model.new_paged_cache(pool, pads),
        None => model.new_padded_cache(pads),
    };
    eval([&model.forward(&ids, &mut cache, Logits::Last)?])?;
    Ok(cache)
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    if a.masked {
        runtime::mask::set_ragged_attention(runtime::mask::RaggedAttention::Never);
    }
    let loaded = LoadedModel::load_as(&a.model, None, ComputeDtype::Auto)?;
    let model = &loaded.model;
    let widest = a.rows.iter().copied().max().unwrap_or(1);
    let longest = a
        .prefill
        .iter()
        .chain(&a.verify)
        .copied()
        .max()
        .unwrap_or(1);
    let pool = a.paged.then(|| {
        let per_row = (a.context + a.steps + longest + 2).div_ceil(16) + 1;
        PagePool::new(model.num_layers(), widest * per_row + per_row, 16)
    });
    let pool = pool.transpose()?;
    println!(
        "{} on {:?}, {} KV, fused CPU nodes {}, packed products {}, context {} positions, means over {} steps",
        a.model.display(),
        mlx_rs::Device::default(),
        if a.paged { "paged" } else { "contiguous" },
        if runtime::cpu_fused::enabled() { "on" } else { "off" },
        runtime::packed::CpuKernel::chosen().map_or("absent", |k| k.name()),
        a.context,
        a.steps
    );
    println!("| shape | nodes | build µs | launch µs | wait µs | step ms |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let report = |shape: String, p: Probe| {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "| {shape} | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
            p.nodes,
            us(p.built),
            us(p.launched),
            us(p.waited),
            (p.built + p.launched + p.waited).as_secs_f64() * 1e3
        );
        if a.histogram {
            let top: Vec<String> = p.by_name.iter().map(|(n, c)| format!("{n} {c}")).collect();
            println!("|   | {} |", top.join(", "));
        }
    };
    for &rows in &a.rows {
        let mut cache = filled(model, pool.as_ref(), rows, a.context)?;
        let token = Array::from_slice(&vec![7i32; rows], &[rows as i32, 1]);
        let p = probe(
            a.steps,
            || {
                Ok(generate::argmax_tokens(&model.forward(
                    &token,
                    &mut cache,
                    Logits::Last,
                )?)?)
            },
            || Ok(()),
        )?;
        report(format!("decode, {rows} rows"), p);
    }
    for (what, widths, logits) in [
        ("verify", &a.verify, Logits::All),
        ("prefill chunk", &a.prefill, Logits::Last),
    ] {
        for &w in widths {
            let cache = std::cell::RefCell::new(filled(model, pool.as_ref(), 1, a.context)?);
            let tokens = Array::from_slice(&vec![7i32; w], &[1, w as i32]);
            let p = probe(
                a.steps,
                || {
                    let logits = model.forward(&tokens, &mut cache.borrow_mut(), logits)?;
                    Ok(mlx_rs::ops::indexing::argmax_axis(&logits, -1, None)?)
                },
                // Back to the same context, as a rejected verify is.
                || cache.borrow_mut().truncate(w as i32),
            )?;
            report(format!("{what}, {w} tokens"), p);
        }
    }
    Ok(())
}
