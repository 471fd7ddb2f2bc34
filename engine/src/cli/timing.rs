//! The step-time prediction on the command line: `--hardware NAME|FILE` (shared by `fsdp
//! plan` and `fsdp train`) and the text and JSON of a [`StepPrediction`].

use super::CliError;
use fsdp_planner::time::{
    builtin_profile, format_seconds, HardwareProfile, StepPrediction, BUILTIN_PROFILE_NAMES,
};
use std::fmt::Write as _;
use std::path::Path;

/// The part of `--hardware`'s help that `fsdp plan` and `fsdp train` share.
macro_rules! hardware_help {
    () => {
        "The hardware profile the step-time model uses: a built-in name (h100-sxm, h200, a100-80gb: vendor figures, each with its source in planner/profiles/) or the path of an fsdp-hardware/1 JSON file (`fsdp calibrate` measures this machine into one). MFU is printed only with a profile: its peak is the denominator"
    };
}

/// Help text of `--hardware` as both subcommands describe the profile.
pub const HARDWARE_HELP: &str = hardware_help!();

/// Help text of `fsdp plan --hardware`.
pub const PLAN_HARDWARE_HELP: &str = concat!(
    hardware_help!(),
    ". Implies --time: the predicted step is printed after the plan (a `time` object in JSON). With --strategy auto the plans that fit --device-memory are ranked by predicted step time"
);

/// Help text of `fsdp train --hardware`.
pub const TRAIN_HARDWARE_HELP: &str = concat!(
    hardware_help!(),
    ". The summary compares the measured step time with the prediction for the run's plan. With --strategy auto the plans that fit the memory budget are ranked by predicted step time (without --hardware: the fixed order), and the choice names its predicted step and the runner-up"
);

/// The file a `--hardware` value reads, or `None` for a built-in name (which wins over a file
/// of that name, as in [`load_hardware`]).
pub fn hardware_file(arg: &str) -> Option<&Path> {
    (!BUILTIN_PROFILE_NAMES.contains(&arg)).then(|| Path::new(arg))
}

/// Resolves `--hardware ARG`: a built-in profile name, else an existing file read as an
/// `fsdp-hardware/1` profile.
///
/// Errors: [`CliError::Usage`] (exit 2): an unknown name (listing the built-in names), an
/// unreadable file, or a profile with a missing, negative or non-finite field (naming its JSON
/// path).
pub fn load_hardware(arg: &str) -> Result<HardwareProfile, CliError> {
    let usage = |e: fsdp_planner::PlanError| CliError::Usage(format!("--hardware: {e}"));
    let path = Path::new(arg);
    // A built-in name wins over a file of that name; a missing path gets the list of names.
    let looks_like_a_path = arg.contains('/') || arg.ends_with(".json");
    if !path.exists() && looks_like_a_path && !BUILTIN_PROFILE_NAMES.contains(&arg) {
        return Err(CliError::Usage(format!(
            "--hardware {arg}: no such file; give an existing profile file (`fsdp calibrate -o \
             FILE` measures one) or a built-in name ({})",
            BUILTIN_PROFILE_NAMES.join(", ")
        )));
    }
    if BUILTIN_PROFILE_NAMES.contains(&arg) || !path.exists() {
        return builtin_profile(arg).map_err(usage);
    }
    if !path.is_file() {
        return Err(CliError::Usage(format!(
            "--hardware {arg}: is not a file; give a built-in name ({}) or a profile JSON file",
            BUILTIN_PROFILE_NAMES.join(", ")
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Usage(format!("--hardware {arg}: cannot read it: {e}")))?;
    HardwareProfile::from_json(&text, arg).map_err(usage)
}

/// What kind of device a hardware profile describes, as far as it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProfileDevice {
    /// A GPU: one of the built-in profiles (all of them GPUs), unchanged, or one `fsdp
    /// calibrate --device cuda` measured (its description says so).
    Gpu,
    /// This or another host's CPU: a profile `fsdp calibrate` measured (it measures the CPU
    /// only, and its description says "measured by fsdp calibrate").
    Cpu,
    /// A profile that does not say (a hand-written file).
    Unknown,
}

/// The phrase [`crate::calibrate`] writes into every profile's description.
const CALIBRATED_MARK: &str = "measured by fsdp calibrate";
/// The phrase of a profile measured on a GPU (`fsdp calibrate --device cuda`).
const CALIBRATED_GPU_MARK: &str = "measured by fsdp calibrate --device cuda";

/// What device `p` describes: [`ProfileDevice::Gpu`] for a built-in profile (name and every
/// number equal to the built-in of that name) or one calibrated on a GPU,
/// [`ProfileDevice::Cpu`] for one calibrated on the CPU, else [`ProfileDevice::Unknown`].
pub fn profile_device(p: &HardwareProfile) -> ProfileDevice {
    let builtin = BUILTIN_PROFILE_NAMES.contains(&p.name.as_str())
        && builtin_profile(&p.name).is_ok_and(|b| &b == p);
    if builtin || p.description.contains(CALIBRATED_GPU_MARK) {
        ProfileDevice::Gpu
    } else if p.description.contains(CALIBRATED_MARK) {
        ProfileDevice::Cpu
    } else {
        ProfileDevice::Unknown
    }
}

/// The note of `fsdp plan` / `fsdp train --hardware` when a profile `fsdp calibrate` measured
/// on a CPU with `ranks_per_node` rank threads is used for `ranks` ranks on one host: on a
/// CPU every rank's rates are its share of the cores, so the profile describes another
/// sharing of them. `None` for any other profile or when the counts agree.
pub fn calibrated_ranks_note(p: &HardwareProfile, ranks: u64) -> Option<String> {
    (profile_device(p) == ProfileDevice::Cpu && p.ranks_per_node != ranks).then(|| {
        let skew = if p.rank_skew > 0.0 {
            format!(
                " and its rank skew ({}) is how much slower the slowest of those ranks ran",
                p.rank_skew
            )
        } else {
            String::new()
        };
        format!(
            "note: the {} profile was calibrated with {} rank thread(s) on its host; this \
             plan has {ranks} per host, and on a CPU each rank's rates are its share of the \
             cores{skew}: `fsdp calibrate --world-size {ranks}` measures the profile for it",
            p.name, p.ranks_per_node
        )
    })
}

/// The note of `fsdp train --hardware` when the profile does not describe the device the run
/// computes on (`run_on_gpu`: `--device cuda`): a GPU profile for a CPU run, or a calibrated
/// CPU profile for a GPU run. `None` when they agree or the profile does not say. The
/// comparison is still made; the note says what it compares.
pub fn device_mismatch(p: &HardwareProfile, run_on_gpu: bool) -> Option<String> {
    match (profile_device(p), run_on_gpu) {
        (ProfileDevice::Gpu, false) => Some(format!(
            "note: the {} profile describes a GPU; this run computes on the CPU: the \
             prediction is of that hardware, not of this run",
            p.name
        )),
        (ProfileDevice::Cpu, true) => Some(format!(
            "note: the {} profile describes a CPU (calibrated: {}); this run computes on a \
             GPU: the prediction is of that hardware, not of this run",
            p.name, p.description
        )),
        _ => None,
    }
}

/// A share as a percentage with one decimal.
fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// A FLOP rate in TFLOP/s from 1e12 up, else GFLOP/s, one decimal.
fn flop_rate(x: f64) -> String {
    if x >= 1e12 {
        format!("{:.1} TFLOP/s", x / 1e12)
    } else {
        format!("{:.1} GFLOP/s", x / 1e9)
    }
}

/// Tokens per second, rounded, with thousands separators.
fn tokens(x: f64) -> String {
    fsdp_types::group_thousands(x.round() as u64)
}

/// ` (12.0 ms of it waiting for the slowest rank)`, or nothing without a rank skew.
fn skew_note(skew_wait_s: f64) -> String {
    if skew_wait_s > 0.0 {
        format!(
            " ({} of it waiting for the slowest rank)",
            format_seconds(skew_wait_s)
        )
    } else {
        String::new()
    }
}

/// The text block of a prediction (`fsdp plan --time`): step time, tokens/s, exposed
/// communication, MFU with its formula and peak, per-phase times and the bottleneck.
pub fn render_prediction(p: &StepPrediction) -> String {
    let mut o = String::new();
    let ranks = if p.skew_wait_s > 0.0 {
        "the mean rank simulated, paced by the slowest (the profile's rank skew)"
    } else {
        "one rank simulated, every rank alike"
    };
    let _ = writeln!(
        o,
        "predicted step on {} (W={}; {ranks}):",
        p.hardware, p.world_size
    );
    let _ = writeln!(
        o,
        "  step time        {:>10}   {} tokens/s over all ranks ({} tokens per step)",
        format_seconds(p.step_s),
        tokens(p.tokens_per_s),
        p.tokens_per_step
    );
    let _ = writeln!(
        o,
        "  compute          {:>10}   {} (slowed while a collective runs)",
        format_seconds(p.compute_s),
        fsdp_planner::time::compute_phases(&p.uses)
    );
    let skew = skew_note(p.skew_wait_s);
    let _ = writeln!(
        o,
        "  exposed comm     {:>10}   compute thread blocked{skew}; communication thread busy {}",
        format_seconds(p.exposed_comm_s),
        format_seconds(p.comm_busy_s)
    );
    let _ = writeln!(
        o,
        "  optimizer        {:>10}   gradient division, norm, clip, optimizer pass",
        format_seconds(p.optimizer_s)
    );
    let _ = writeln!(
        o,
        "  copies           {:>10}   casts, gradient copies and additions",
        format_seconds(p.copy_s)
    );
    if p.host_copy_s > 0.0 {
        let _ = writeln!(
            o,
            "  host link        {:>10}   offload copies",
            format_seconds(p.host_copy_s)
        );
    }
    let _ = writeln!(
        o,
        "  MFU              {:>10}   model FLOPs {:.3e}/step by {}; peak {} per rank from the profile",
        pct(p.mfu),
        p.model_flops_per_step,
        p.flop_formula,
        flop_rate(p.peak_flops_per_s)
    );
    let _ = writeln!(
        o,
        "  HFU              {:>10}   counted FLOPs {:.3e}/step (recompute included; attention only where computed){}",
        pct(p.hfu),
        p.hardware_flops_per_step,
        if p.hfu < p.mfu {
            "; below MFU because the model FLOPs count every one of the T x T attention scores and a causal step computes about half"
        } else {
            ""
        }
    );
    let phases: Vec<String> = p
        .phases
        .iter()
        .map(|ph| {
            format!(
                "{} {} (exposed comm {})",
                ph.phase.name(),
                format_seconds(ph.wall_s),
                format_seconds(ph.exposed_comm_s)
            )
        })
        .collect();
    let _ = writeln!(o, "  phases: {}", phases.join(", "));
    let _ = writeln!(o, "  bottleneck: {}", p.bottleneck);
    o
}

/// The `time` object of `fsdp plan --format json` (schema `fsdp-plan/2`, planner/SCHEMA.md):
/// the prediction without its spans (those go to `--trace`).
pub fn prediction_json(p: &StepPrediction) -> Result<serde_json::Value, CliError> {
    let mut v = serde_json::to_value(p)
        .map_err(|e| CliError::Failed(format!("serializing the prediction: {e}")))?;
    if let Some(m) = v.as_object_mut() {
        m.remove("spans");
    }
    Ok(v)
}

/// A run's measured step time against the prediction for the same plan (`fsdp train
/// --hardware`).
#[derive(Debug, Clone, PartialEq)]
pub struct StepComparison {
    /// The profile's name.
    pub hardware: String,
    /// Predicted seconds per step.
    pub predicted_s: f64,
    /// Predicted seconds per step the compute thread waits for collectives (exposed
    /// communication; the measured counterpart is each step's `comm_exposed_seconds`).
    pub predicted_exposed_comm_s: f64,
    /// Of `predicted_exposed_comm_s`, the seconds the mean rank waits for the slowest (the
    /// profile's `rank_skew`; 0 without one).
    pub predicted_skew_wait_s: f64,
    /// Measured seconds per step: the median step time of the run excluding its first step
    /// (which pays one-time allocations); the only step when the run had one.
    pub measured_s: f64,
    /// How many steps the median is over.
    pub measured_steps: usize,
    /// Whether the first step was excluded.
    pub first_excluded: bool,
    /// `measured / predicted - 1`: positive when the run was slower than predicted.
    pub error: f64,
    /// Measured tokens per second over all ranks, at the median step time.
    pub tokens_per_s: f64,
    /// Measured MFU: the prediction's model FLOPs per step / (measured step x W x the
    /// profile's peak).
    pub mfu: f64,
    /// Measured HFU: the prediction's counted (hardware) FLOPs per step, recompute included
    /// and attention only where computed / (measured step x W x the profile's peak).
    pub hfu: f64,
    /// The FLOP formula of `mfu`.
    pub flop_formula: String,
    /// The profile's peak FLOP/s per rank the MFU divides by.
    pub peak_flops_per_s: f64,
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(s[n / 2]),
        _ => Some(0.5 * (s[n / 2 - 1] + s[n / 2])),
    }
}

/// Compares the measured step times (`step_seconds`, in step order) with `pred`; `None` when
/// no step ran.
pub fn compare(pred: &StepPrediction, step_seconds: &[f64]) -> Option<StepComparison> {
    let first_excluded = step_seconds.len() > 1;
    let counted = if first_excluded {
        &step_seconds[1..]
    } else {
        step_seconds
    };
    let measured_s = median(counted)?;
    let w = pred.world_size as f64;
    Some(StepComparison {
        hardware: pred.hardware.clone(),
        predicted_s: pred.step_s,
        predicted_exposed_comm_s: pred.exposed_comm_s,
        predicted_skew_wait_s: pred.skew_wait_s,
        measured_s,
        measured_steps: counted.len(),
        first_excluded,
        error: measured_s / pred.step_s - 1.0,
        tokens_per_s: pred.tokens_per_step as f64 / measured_s,
        mfu: pred.model_flops_per_step / (measured_s * w * pred.peak_flops_per_s),
        hfu: pred.hardware_flops_per_step / (measured_s * w * pred.peak_flops_per_s),
        flop_formula: pred.flop_formula.clone(),
        peak_flops_per_s: pred.peak_flops_per_s,
    })
}

/// The summary lines of a comparison: `predicted 1.23 s/step, measured 1.31 s (+6.5%)`, the
/// measured tokens/s, MFU with its formula and peak, and HFU (the FLOPs the step computes).
pub fn render_comparison(c: &StepComparison) -> String {
    let which = if c.first_excluded {
        format!("median of {} steps, the first excluded", c.measured_steps)
    } else {
        "the only step".to_string()
    };
    let skew = skew_note(c.predicted_skew_wait_s);
    format!(
        "step time on {}: predicted {}/step{skew}, measured {} ({:+.1}%; {which})\n\
         measured {} tokens/s at that step | MFU {} (model FLOPs by {}; peak {} per rank from \
         the profile) | HFU {} (the FLOPs computed: recompute included, attention only where \
         computed)\n",
        c.hardware,
        format_seconds(c.predicted_s),
        format_seconds(c.measured_s),
        100.0 * c.error,
        tokens(c.tokens_per_s),
        pct(c.mfu),
        c.flop_formula,
        flop_rate(c.peak_flops_per_s),
        pct(c.hfu)
    )
}

/// The summary line of a comparison whose profile describes another kind of device than the
/// run's (a GPU profile on a CPU run): both step times, but no error and no MFU, which would
/// compare this run with another machine.
pub fn render_other_device(c: &StepComparison) -> String {
    format!(
        "step time: predicted {}/step on {} (another kind of device: no error or MFU against \
         this run), measured {} on this run\n",
        format_seconds(c.predicted_s),
        c.hardware,
        format_seconds(c.measured_s)
    )
}

/// The JSON summary fields of a comparison.
pub fn comparison_json(c: &StepComparison) -> serde_json::Value {
    serde_json::json!({
        "hardware": c.hardware,
        "predicted_step_s": c.predicted_s,
        "predicted_exposed_comm_s": c.predicted_exposed_comm_s,
        "predicted_skew_wait_s": c.predicted_skew_wait_s,
        "measured_step_s": c.measured_s,
        "measured_steps": c.measured_steps,
        "first_step_excluded": c.first_excluded,
        "step_time_error": c.error,
        "measured_tokens_per_s": c.tokens_per_s,
        "mfu": c.mfu,
        "hfu": c.hfu,
        "flop_formula": c.flop_formula,
        "peak_flops_per_s": c.peak_flops_per_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_of_the_other_device_kind_gets_a_note_naming_both() {
        let gpu = builtin_profile("h100-sxm").unwrap();
        assert_eq!(profile_device(&gpu), ProfileDevice::Gpu);
        assert_eq!(device_mismatch(&gpu, true), None);
        assert_eq!(
            device_mismatch(&gpu, false).as_deref(),
            Some(
                "note: the h100-sxm profile describes a GPU; this run computes on the CPU: the \
                 prediction is of that hardware, not of this run"
            )
        );
        // The description `fsdp calibrate` writes marks a CPU profile.
        let mut cpu = gpu.clone();
        cpu.name = "here".into();
        cpu.description =
            "box: 2 rank threads of 4 compute threads, measured by fsdp calibrate on 2026-01-01"
                .into();
        assert_eq!(profile_device(&cpu), ProfileDevice::Cpu);
        assert_eq!(device_mismatch(&cpu, false), None);
        assert_eq!(
            device_mismatch(&cpu, true).as_deref(),
            Some(
                "note: the here profile describes a CPU (calibrated: box: 2 rank threads of 4 \
                 compute threads, measured by fsdp calibrate on 2026-01-01); this run computes \
                 on a GPU: the prediction is of that hardware, not of this run"
            )
        );
        // A profile `fsdp calibrate --device cuda` measured describes a GPU.
        let mut measured_gpu = cpu.clone();
        measured_gpu.description = "NVIDIA H200 (CUDA device 0 of 1) on box, measured by fsdp \
             calibrate --device cuda on 2026-01-01"
            .into();
        assert_eq!(profile_device(&measured_gpu), ProfileDevice::Gpu);
        assert_eq!(device_mismatch(&measured_gpu, true), None);
        // A calibrated CPU profile used at another world size is noted; at its own, or a
        // GPU's at any, is not.
        cpu.ranks_per_node = 2;
        assert_eq!(calibrated_ranks_note(&cpu, 2), None);
        assert_eq!(
            calibrated_ranks_note(&cpu, 4).as_deref(),
            Some(
                "note: the here profile was calibrated with 2 rank thread(s) on its host; this \
                 plan has 4 per host, and on a CPU each rank's rates are its share of the \
                 cores: `fsdp calibrate --world-size 4` measures the profile for it"
            )
        );
        assert_eq!(calibrated_ranks_note(&gpu, 4), None);
        // A fitted rank skew is named as one of the numbers that depend on the ranks.
        cpu.rank_skew = 0.05;
        assert_eq!(
            calibrated_ranks_note(&cpu, 4).as_deref(),
            Some(
                "note: the here profile was calibrated with 2 rank thread(s) on its host; this \
                 plan has 4 per host, and on a CPU each rank's rates are its share of the \
                 cores and its rank skew (0.05) is how much slower the slowest of those ranks \
                 ran: `fsdp calibrate --world-size 4` measures the profile for it"
            )
        );
        cpu.rank_skew = 0.0;
        // A built-in's name with other numbers, or a hand-written file, does not say.
        let mut edited = gpu.clone();
        edited.overlap_slowdown += 0.5;
        assert_eq!(profile_device(&edited), ProfileDevice::Unknown);
        assert_eq!(device_mismatch(&edited, false), None);
        assert_eq!(device_mismatch(&edited, true), None);
    }
}
