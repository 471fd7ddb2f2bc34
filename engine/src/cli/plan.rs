//! `fsdp plan`: read a model description, plan it, print a table, JSON or an SVG timeline.
//!
//! A thin shell over `fsdp_planner`: parsing flags into a `PlanConfig`, choosing the model
//! reader, and writing the rendered report. Every bad input becomes `CliError::Usage` (exit 2).

use super::args::{
    parse_device_memory, CheckpointingArg, DTypeArg, OffloadArg, CHECKPOINTING_HELP, OFFLOAD_HELP,
};
use super::CliError;
use fsdp_planner::config::{ActivationModel, GradSync, Optimizer, PlanConfig, Strategy};
use fsdp_planner::{hf, plan, preset, report, Architecture, ModelSpec, PlanError};
use std::path::{Path, PathBuf};

/// Output format of `fsdp plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Human-readable table.
    Table,
    /// JSON, schema `fsdp-plan/2` (planner/SCHEMA.md).
    Json,
    /// SVG memory timeline of one step.
    Svg,
}

/// Sharding strategy names on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// Shard params, grads, optimizer state; reshard after forward (ZeRO-3; alias zero3).
    #[value(alias = "zero3")]
    FullShard,
    /// Shard grads and optimizer state; keep params unsharded after forward (ZeRO-2; alias
    /// zero2).
    #[value(alias = "zero2")]
    ShardGradOp,
    /// Shard optimizer state, master weights and reduced gradients; params stay replicated
    /// through the step and are gathered once per step (ZeRO-1).
    #[value(alias = "zero1")]
    ShardOptimizer,
    /// Replicate everything (DDP; alias ddp).
    #[value(alias = "ddp")]
    NoShard,
    /// Full shard inside groups of --shard-size ranks, replicated across groups (HSDP; alias
    /// hsdp).
    #[value(alias = "hsdp")]
    Hybrid,
    /// The fastest strategy that fits --device-memory.
    Auto,
}

/// Optimizer names on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerArg {
    /// AdamW: two f32 moments per trainable element.
    Adamw,
    /// SGD, with a momentum buffer when --momentum is not 0.
    Sgd,
}

/// Gradient sync modes on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradSyncArg {
    /// Reduce-scatter every micro-batch (default).
    Every,
    /// Accumulate unsharded gradients, reduce on the last micro-batch only.
    Last,
}

/// The device `fsdp train --device` will run on, which picks the activation model the way the
/// engine's `OpsPath::Auto` picks the ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanDeviceArg {
    /// Host CPU: the fused CPU ops (`ActivationModel::Fused`).
    Cpu,
    /// A CUDA GPU: the composite ops (`ActivationModel::Composite`).
    Cuda,
}

/// Which ops path's activations to plan (`--activations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ActivationsArg {
    /// From `--device`: fused on the CPU, composite on CUDA.
    Auto,
    /// The fused CPU ops (`engine/src/model/ops.rs`).
    Fused,
    /// The composite ops (`engine/src/model/composite.rs`; CUDA, or
    /// `Gpt::with_ops_path(OpsPath::Composite)` on the CPU).
    Composite,
}

/// Arguments of `fsdp plan`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "hf_config", "safetensors", "spec"])))]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    /// Built-in preset: tiny, mini, small, base, gpt2, gpt2-medium, gpt2-large, gpt2-xl,
    /// llama-tiny, llama-mini, llama2-7b, llama3-8b, llama3-70b.
    #[arg(long)]
    pub model: Option<String>,
    /// A Hugging Face config.json (GPT-2, Llama, Mistral, Qwen2).
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// A .safetensors file (header only is read) or a sharded model's
    /// model.safetensors.index.json.
    #[arg(long, value_name = "FILE")]
    pub safetensors: Option<PathBuf>,
    /// A ModelSpec as JSON (`{"name", "units": [{"name", "params": [{"name", "shape",
    /// "dtype", "trainable", "weight_decay", "tied_to"}]}], "arch": {"family": "generic"}}`).
    #[arg(long, value_name = "FILE")]
    pub spec: Option<PathBuf>,
    /// World size W (number of ranks).
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one_u64)]
    pub world_size: u64,
    /// Sharding strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::FullShard)]
    pub strategy: StrategyArg,
    /// Shard-group size for --strategy hybrid (must divide the world size).
    #[arg(long, value_parser = super::checks::at_least_one_u64)]
    pub shard_size: Option<u64>,
    /// Unit-level activation checkpointing (`on`/`off`; default: the strategy's).
    #[arg(long, value_enum, value_name = "on|off", help = CHECKPOINTING_HELP)]
    pub activation_checkpointing: Option<CheckpointingArg>,
    /// What lives in host memory (`none`/`optimizer`/`params`).
    #[arg(long, value_enum, value_name = "none|optimizer|params", help = OFFLOAD_HELP)]
    pub offload: Option<OffloadArg>,
    /// Plan asynchronous checkpoint saves (as `fsdp train --ckpt-async`): each rank's host
    /// staging copy of its master and optimizer-state shards and the writer's buffer, in host
    /// memory at every point. The fingerprint does not change.
    #[arg(long)]
    pub ckpt_async: bool,
    /// dtype of unsharded params in forward/backward (as `fsdp train`).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub param_dtype: DTypeArg,
    /// dtype of gradient reduction (as `fsdp train`).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub reduce_dtype: DTypeArg,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,
    /// SGD momentum (0 = no state).
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Sequences per micro-batch per rank.
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one_u64)]
    pub micro_batch: u64,
    /// Tokens per sequence (default: 1024, or the model's position table / maximum sequence
    /// length if shorter).
    #[arg(long, value_parser = super::checks::at_least_one_u64)]
    pub seq_len: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1, value_parser = super::checks::at_least_one_u64)]
    pub grad_accum: u64,
    /// When gradients are reduced during accumulation.
    #[arg(long, value_enum, default_value_t = GradSyncArg::Every)]
    pub grad_sync: GradSyncArg,
    /// Units gathered ahead, forward and backward.
    #[arg(long, default_value_t = 1, value_parser = super::checks::whole_number_u64)]
    pub prefetch: u64,
    /// Alignment of each parameter inside its flat parameter, in elements.
    #[arg(long, default_value_t = 1)]
    pub alignment: u64,
    /// The device the run computes on (as `fsdp train --device`): `cuda` plans the
    /// activations of the composite ops a GPU runs. Default: `cuda` with a `--hardware`
    /// profile of a GPU (the built-in ones), else `cpu`.
    #[arg(long, value_enum)]
    pub device: Option<PlanDeviceArg>,
    /// Whose activations to plan: `auto` (from --device), `fused` (CPU only) or `composite`.
    #[arg(long, value_enum, default_value_t = ActivationsArg::Auto)]
    pub activations: ActivationsArg,
    /// Memory per device, e.g. 80GiB, 40GB, 512MiB.
    #[arg(long, allow_hyphen_values = true)]
    pub device_memory: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Write the output to FILE instead of standard output.
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Predict one step's time on --hardware (required with it; --hardware alone implies
    /// it): step time, tokens/s, exposed communication, MFU, per-phase times and the
    /// bottleneck (table: after the plan; JSON: a `time` object).
    #[arg(long)]
    pub time: bool,
    /// The hardware profile of the prediction (implies --time) and of auto's ranking (see
    /// `PLAN_HARDWARE_HELP`).
    #[arg(long, value_name = "NAME|FILE", help = super::timing::PLAN_HARDWARE_HELP)]
    pub hardware: Option<String>,
    /// With --hardware: write the predicted step as Chrome trace event JSON (opens in Perfetto
    /// or chrome://tracing), a compute and a communication track.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
}

fn usage(e: PlanError) -> CliError {
    CliError::Usage(e.to_string())
}

/// As [`usage`], with a profile's error headed `--hardware:` (as `fsdp train` heads it).
fn hardware_usage(e: PlanError) -> CliError {
    match e {
        PlanError::BadProfile { .. } => CliError::Usage(format!("--hardware: {e}")),
        e => usage(e),
    }
}

/// Builds the planner configuration from the flags. Errors: `CliError::Usage`.
pub fn config_from_args(a: &PlanArgs) -> Result<PlanConfig, CliError> {
    let strategy = match a.strategy {
        StrategyArg::FullShard => Strategy::FullShard,
        StrategyArg::ShardGradOp => Strategy::ShardGradOp,
        StrategyArg::ShardOptimizer => Strategy::ShardOptimizer,
        StrategyArg::NoShard => Strategy::NoShard,
        StrategyArg::Auto => Strategy::Auto,
        StrategyArg::Hybrid => Strategy::Hybrid {
            shard_size: a.shard_size.ok_or_else(|| {
                CliError::Usage(
                    "--strategy hybrid needs --shard-size N (N divides the world size)".into(),
                )
            })?,
        },
    };
    if a.shard_size.is_some() && a.strategy != StrategyArg::Hybrid {
        return Err(CliError::Usage(
            "--shard-size applies to --strategy hybrid only".into(),
        ));
    }
    let device_memory = a
        .device_memory
        .as_deref()
        .map(parse_device_memory)
        .transpose()?;
    let activations =
        match (a.activations, a.device.unwrap_or(PlanDeviceArg::Cpu)) {
            (ActivationsArg::Auto, PlanDeviceArg::Cpu)
            | (ActivationsArg::Fused, PlanDeviceArg::Cpu) => ActivationModel::Fused,
            (ActivationsArg::Auto, PlanDeviceArg::Cuda) | (ActivationsArg::Composite, _) => {
                ActivationModel::Composite
            }
            (ActivationsArg::Fused, PlanDeviceArg::Cuda) => return Err(CliError::Usage(
                "--activations fused is the CPU ops path; --device cuda runs the composite ops \
                 (use --activations composite or auto)"
                    .into(),
            )),
        };
    let cfg = PlanConfig {
        world_size: a.world_size,
        strategy,
        param_dtype: a.param_dtype.dtype(),
        reduce_dtype: a.reduce_dtype.dtype(),
        optimizer: match a.optimizer {
            OptimizerArg::Adamw => Optimizer::AdamW,
            OptimizerArg::Sgd => Optimizer::Sgd {
                momentum: a.momentum,
            },
        },
        grad_accum: a.grad_accum,
        grad_sync: match a.grad_sync {
            GradSyncArg::Every => GradSync::EveryMicroBatch,
            GradSyncArg::Last => GradSync::LastMicroBatch,
        },
        prefetch: a.prefetch,
        micro_batch: a.micro_batch,
        seq_len: a.seq_len.unwrap_or(DEFAULT_SEQ_LEN),
        alignment: a.alignment,
        device_memory,
        activations,
        activation_checkpointing: a.activation_checkpointing.map(CheckpointingArg::enabled),
        offload: a.offload.map(OffloadArg::offload),
        ckpt_async: a.ckpt_async,
    };
    cfg.validate().map_err(usage)?;
    Ok(cfg)
}

/// `--seq-len` when neither the flag nor the model bounds it: 1024 tokens.
pub const DEFAULT_SEQ_LEN: u64 = 1024;

/// The `--seq-len` used when the flag is not given: [`DEFAULT_SEQ_LEN`], capped at the model's
/// position table (GPT-2 `n_positions`) or configured maximum sequence length (Llama
/// `max_position_embeddings`), so `fsdp plan --model tiny` (256 positions) plans 256 tokens.
pub fn default_seq_len(spec: &ModelSpec) -> u64 {
    let cap = match &spec.arch {
        Architecture::Gpt2(c) => c.n_positions,
        Architecture::Llama(c) => c.max_seq,
        Architecture::Generic => DEFAULT_SEQ_LEN,
    };
    DEFAULT_SEQ_LEN.min(cap.max(1))
}

/// Reads the model named by `--model`, `--hf-config` or `--safetensors`.
pub fn model_from_args(a: &PlanArgs) -> Result<ModelSpec, CliError> {
    if let Some(m) = &a.model {
        return preset(m).map_err(usage);
    }
    if let Some(p) = &a.hf_config {
        // The model `fsdp train --hf-config` trains, or the same refusal: a Llama-family
        // config whose math or parameters the layout does not describe (biases, head_dim,
        // another rope scaling) is not planned with the wrong shapes.
        return crate::model::decoder::Decoder::from_hf_config(p)
            .map(|m| crate::runtime::StagedModel::spec(&m).clone())
            .map_err(|e| CliError::Usage(e.to_string()));
    }
    if let Some(p) = &a.safetensors {
        return hf::read_safetensors_model(p).map_err(usage);
    }
    if let Some(p) = &a.spec {
        let text = std::fs::read_to_string(p)
            .map_err(|e| CliError::Usage(format!("{}: {e}", p.display())))?;
        return serde_json::from_str(&text)
            .map_err(|e| CliError::Usage(format!("{}: not a valid model spec: {e}", p.display())));
    }
    Err(CliError::Usage(
        "give one of --model PRESET, --hf-config FILE, --safetensors FILE, --spec FILE".into(),
    ))
}

/// Runs `fsdp plan`.
pub fn run(mut args: PlanArgs) -> Result<(), CliError> {
    // No output may replace one of the inputs.
    let inputs: [(&str, Option<&Path>); 4] = [
        (
            "--hardware",
            args.hardware
                .as_deref()
                .and_then(super::timing::hardware_file),
        ),
        ("--hf-config", args.hf_config.as_deref()),
        ("--safetensors", args.safetensors.as_deref()),
        ("--spec", args.spec.as_deref()),
    ];
    if let Some(o) = &args.output {
        crate::output::check_output_path("-o", o, "plan.json").map_err(CliError::Usage)?;
        crate::output::check_not_an_input("-o", o, &inputs).map_err(CliError::Usage)?;
    }
    if let Some(t) = &args.trace {
        crate::output::check_not_an_input("--trace", t, &inputs).map_err(CliError::Usage)?;
    }
    // The step-time prediction's flags, checked before any work.
    if args.time && args.hardware.is_none() {
        return Err(CliError::Usage(format!(
            "--time needs --hardware NAME|FILE: a built-in profile ({}) or a profile file \
             (fsdp calibrate -o FILE measures this machine)",
            fsdp_planner::time::BUILTIN_PROFILE_NAMES.join(", ")
        )));
    }
    if let Some(t) = &args.trace {
        if args.hardware.is_none() {
            return Err(CliError::Usage(
                "--trace writes the predicted step: add --hardware NAME|FILE".into(),
            ));
        }
        crate::trace::check_trace_path("--trace", t)?;
        if let Some(o) = args
            .output
            .as_deref()
            .filter(|o| crate::output::same_path(o, t))
        {
            return Err(CliError::Usage(format!(
                "-o {} and --trace {} name the same file: one would overwrite the other; give \
                 the trace another path",
                o.display(),
                t.display()
            )));
        }
    }
    // A profile is given to be used: --hardware implies --time.
    let time = args.time || args.hardware.is_some();
    let hardware = args
        .hardware
        .as_deref()
        .map(super::timing::load_hardware)
        .transpose()?;
    if let Some(n) = hardware
        .as_ref()
        .and_then(|h| super::timing::calibrated_ranks_note(h, args.world_size))
    {
        crate::output::errln!("{n}");
    }
    // The device the step is planned and predicted for: a GPU profile without --device plans
    // the GPU's step (the CPU's fused ops priced at a GPU's rates would predict neither);
    // a --device that the profile does not describe is planned as given, with a note.
    if let Some(h) = &hardware {
        match args.device {
            None if super::timing::profile_device(h) == super::timing::ProfileDevice::Gpu => {
                args.device = Some(PlanDeviceArg::Cuda);
                crate::output::errln!(
                    "note: the {} profile describes a GPU: planning the step of --device cuda \
                     (the composite ops); give --device cpu to plan the CPU engine's step",
                    h.name
                );
            }
            Some(d) => {
                if let Some(n) = super::timing::device_mismatch(h, d == PlanDeviceArg::Cuda) {
                    crate::output::errln!("{}", n.replace("this run", "this plan"));
                }
            }
            None => {}
        }
    }
    let time_inputs = fsdp_planner::time::TimeInputs::default();
    // The model `fsdp train` would run (one read of a --hf-config): a Llama-family model with
    // a sliding window (Mistral) trains only within it, so the default sequence stays inside
    // and a longer one is refused as `fsdp train` refuses it.
    let decoder = match &args.hf_config {
        Some(p) => Some(
            crate::model::decoder::Decoder::from_hf_config(p)
                .map_err(|e| CliError::Usage(e.to_string()))?,
        ),
        None => args
            .model
            .as_deref()
            .and_then(|m| crate::model::decoder::Decoder::from_preset(m).ok()),
    };
    // The model is read once: the decoder's spec when it was built (one source is given).
    let spec = match &decoder {
        Some(d) => crate::runtime::StagedModel::spec(d).clone(),
        None => model_from_args(&args)?,
    };
    let window = decoder
        .as_ref()
        .and_then(|d| d.max_seq_len())
        .filter(|(_, f)| *f == "sliding_window")
        .map(|(w, _)| w);
    args.seq_len = Some(args.seq_len.unwrap_or_else(|| {
        let d = default_seq_len(&spec);
        window.map_or(d, |w| d.min(w))
    }));
    if let (Some(d), Some(t)) = (&decoder, args.seq_len) {
        crate::options::check_seq_len(d, t).map_err(|e| CliError::Usage(e.to_string()))?;
    }
    let cfg = config_from_args(&args)?;
    // With a profile, auto ranks the plans that fit by predicted step time.
    let p = match &hardware {
        Some(h) => fsdp_planner::plan_fastest(&spec, &cfg, h, &time_inputs),
        None => plan(&spec, &cfg),
    }
    .map_err(hardware_usage)?;
    let prediction = match (&hardware, time) {
        (Some(h), true) => {
            Some(fsdp_planner::time::predict(&p, h, &time_inputs).map_err(hardware_usage)?)
        }
        _ => None,
    };
    if let (Some(path), Some(pred)) = (&args.trace, &prediction) {
        crate::trace::write_trace(path, &crate::trace::predicted_trace(pred))
            .map_err(CliError::Failed)?;
    }
    let text = match args.format {
        Format::Table => {
            let fit = report::fit_report(&spec, &p).map_err(usage)?;
            let mut t = report::render_table(&p, fit.as_ref());
            if let Some(pred) = &prediction {
                t.push('\n');
                t.push_str(&super::timing::render_prediction(pred));
            }
            t
        }
        Format::Json => {
            let fit = report::fit_report(&spec, &p).map_err(usage)?;
            let mut doc = report::render_json(&p, fit.as_ref());
            if let Some(pred) = &prediction {
                doc["time"] = super::timing::prediction_json(pred)?;
            }
            let mut s = serde_json::to_string_pretty(&doc)
                .map_err(|e| CliError::Failed(format!("serializing the plan: {e}")))?;
            s.push('\n');
            s
        }
        Format::Svg => report::render_svg(&p),
    };
    match &args.output {
        Some(path) => std::fs::write(path, text)
            .map_err(|e| CliError::Usage(format!("cannot write {}: {e}", path.display()))),
        // A closed stdout (`| head`) ends the printing quietly ([`crate::output`]).
        None => {
            crate::output::print_out(&text);
            Ok(())
        }
    }
}
