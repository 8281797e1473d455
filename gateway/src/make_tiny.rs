//! `gateway make-tiny-model`: writes a random-weight model with a real
//! tokenizer and chat template, for tests, benchmarks and the default config.

use anyhow::{bail, Context};
use fixtures::gemma4::Gemma4Shape;
use fixtures::gemma4::Layout;
use fixtures::model::{write_model, TinySpec};
use fixtures::qwen::QwenShape;
use fixtures::vision::{
    write_gemma4_vision_model, write_vision_model, TinyGemma4VisionSpec, TinyVisionSpec,
};
use mlx_rs::Dtype;
use runtime::Family;

use crate::cli::{DrafterKind, DtypeArg, FamilyArg, MakeTinyArgs, MakeTinyDrafterArgs, PresetArg};

pub fn run(args: &MakeTinyArgs) -> anyhow::Result<()> {
    let family = match args.family {
        FamilyArg::Llama => Family::Llama,
        FamilyArg::Qwen2 => Family::Qwen2,
        FamilyArg::Qwen3 | FamilyArg::Qwen3Moe | FamilyArg::Qwen35 | FamilyArg::Qwen35Moe => {
            Family::Qwen3
        }
        FamilyArg::Gemma3 | FamilyArg::Gemma3Vision => Family::Gemma3,
        FamilyArg::Gemma4
        | FamilyArg::Gemma4E2b
        | FamilyArg::Gemma4Dense
        | FamilyArg::Gemma4Vision => Family::Gemma4,
    };
    let vision = matches!(
        args.family,
        FamilyArg::Gemma3Vision | FamilyArg::Gemma4Vision
    );
    if vision && !matches!(args.preset, PresetArg::Tiny) {
        bail!(
            "{} models are written with the tiny preset",
            value_name(&args.family)
        );
    }
    if matches!(args.family, FamilyArg::Gemma3Vision) && args.quant_bits.is_some() {
        bail!("gemma3-vision models are written unquantized");
    }
    // A real-size preset is one model's shape, so it names its family.
    let mut spec = match (args.preset, args.family) {
        (PresetArg::Tiny, _) => TinySpec::tiny(family),
        (PresetArg::Bench, _) => TinySpec::bench(family),
        (PresetArg::Qwen3_4b, FamilyArg::Qwen3) => TinySpec::qwen3_4b(),
        (PresetArg::Qwen35_4b, FamilyArg::Qwen35) => TinySpec::qwen35_4b(),
        (PresetArg::Qwen3_30bA3b, FamilyArg::Qwen3Moe) => TinySpec::qwen3_30b_a3b(),
        (PresetArg::Gemma4_26bA4b, FamilyArg::Gemma4) => TinySpec::gemma4_26b_a4b(),
        (preset, _) => {
            let family = match preset {
                PresetArg::Qwen35_4b => FamilyArg::Qwen35,
                PresetArg::Qwen3_30bA3b => FamilyArg::Qwen3Moe,
                PresetArg::Gemma4_26bA4b => FamilyArg::Gemma4,
                _ => FamilyArg::Qwen3,
            };
            bail!(
                "the {} preset is a {} shape; use --family {1}",
                value_name(&preset),
                value_name(&family),
            )
        }
    };
    // Tiny and bench size any family; the family flag picks the shape.
    let sized_by_preset = matches!(args.preset, PresetArg::Tiny | PresetArg::Bench);
    if family == Family::Gemma4 && sized_by_preset {
        let layers = spec.layers;
        spec.gemma4 = Some(match args.family {
            FamilyArg::Gemma4E2b => Gemma4Shape::e2b(layers),
            FamilyArg::Gemma4Dense => Gemma4Shape::dense_31b(layers),
            FamilyArg::Gemma4Vision => TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)
                .text
                .gemma4
                .expect("a Gemma 4 shape"),
            _ => Gemma4Shape::moe_26b(layers),
        });
    }
    if sized_by_preset {
        spec.qwen = match args.family {
            FamilyArg::Qwen3Moe => Some(QwenShape::qwen3_moe()),
            FamilyArg::Qwen35 => Some(QwenShape::qwen35()),
            FamilyArg::Qwen35Moe => Some(QwenShape::qwen35_moe()),
            _ => None,
        };
    }
    if args.mtp_layers > 0 {
        let shape = spec
            .qwen
            .take()
            .filter(|q| q.linear.is_some())
            .context("--mtp-layers: only Qwen 3.5 checkpoints ship an MTP head")?;
        spec.qwen = Some(shape.with_mtp(args.mtp_layers));
    }
    if let Some(dtype) = args.dtype {
        spec.dtype = match dtype {
            DtypeArg::F32 => Dtype::Float32,
            DtypeArg::Bf16 => Dtype::Bfloat16,
            DtypeArg::F16 => Dtype::Float16,
        };
    }
    if let Some(bits) = &args.quant_bits {
        spec.quant_bits = Some(bits.parse().context("--quant-bits")?);
    }
    spec.seed = args.seed;
    if let Some(context) = args.context {
        spec.context = context;
    }
    match args.family {
        FamilyArg::Gemma3Vision => write_vision_model(
            &args.out,
            &TinyVisionSpec {
                text: spec.clone(),
                ..TinyVisionSpec::tiny()
            },
        ),
        FamilyArg::Gemma4Vision => write_gemma4_vision_model(
            &args.out,
            &TinyGemma4VisionSpec {
                text: spec.clone(),
                ..TinyGemma4VisionSpec::tiny(Layout::HfMultimodal)
            },
        ),
        _ => write_model(&args.out, &spec),
    }
    .with_context(|| format!("writing {}", args.out.display()))?;
    let family = match (&spec.qwen, vision) {
        (_, true) => value_name(&args.family),
        (Some(q), _) => q.model_type().to_string(),
        _ => family.to_string(),
    };
    println!(
        "wrote a {family} model ({} text-model parameters) to {}",
        spec.parameters(),
        args.out.display()
    );
    Ok(())
}

/// `gateway make-tiny-drafter`.
pub fn run_drafter(args: &MakeTinyDrafterArgs) -> anyhow::Result<()> {
    match args.kind {
        DrafterKind::Dflash => fixtures::dflash::write_drafter(
            &args.target,
            &args.out,
            &fixtures::dflash::TinyDflash {
                layers: args.layers,
                block_size: args.block_size,
                seed: args.seed,
                ..fixtures::dflash::TinyDflash::default()
            },
        ),
        DrafterKind::Mtp => fixtures::mtp::write_drafter(
            &args.target,
            &args.out,
            &fixtures::mtp::TinyAssistant {
                hidden: args.hidden,
                layers: args.layers,
                seed: args.seed,
                ..fixtures::mtp::TinyAssistant::default()
            },
        ),
    }
    .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote a {:?} drafter for {} to {}",
        args.kind,
        args.target.display(),
        args.out.display()
    );
    Ok(())
}

/// How the command line spells `v`.
fn value_name(v: &impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}
