//! Checks `fsdp train` makes on its flags before any work: clap value parsers for the
//! hyperparameters (a bad value exits 2 at parse time with the value, the rule and the fix),
//! and notes on flag combinations that run but may surprise (warmup past the last step).

use crate::train::TrainOptions;

/// Parses a finite number `>= 0` (`--weight-decay`, `--min-lr`, `--clip`).
///
/// Errors: the rule and the fix, for clap's `invalid value '...' for '--flag'` message.
pub fn non_negative(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give a finite number >= 0, e.g. 0.1"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!(
            "must be a finite number >= 0 (0 turns it off), got {v}; e.g. 0.1"
        ));
    }
    Ok(v)
}

/// Parses a finite number `> 0` and at most the largest f32 (`--lr`).
///
/// Errors: the rule and the fix, for clap's message.
pub fn positive(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number; give a finite number > 0, e.g. 1e-3"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("must be a finite number > 0, got {v}; e.g. 1e-3"));
    }
    // The optimizer multiplies f32 values by it: beyond the largest f32 it is infinite there.
    if v > f32::MAX as f64 {
        return Err(format!(
            "must be at most {:e} (the largest f32, which the optimizer computes in), got {v:e}; \
             e.g. 1e-3",
            f32::MAX
        ));
    }
    Ok(v)
}

/// Parses a number of seconds in `(0, 1e6]` (`--comm-timeout`).
///
/// Errors: the rule and the fix, for clap's message.
pub fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds; e.g. 60"))?;
    if !(v.is_finite() && v > 0.0 && v <= crate::process::MAX_WAIT_SECONDS) {
        return Err(format!(
            "must be a number of seconds in (0, {:e}], got {v}; e.g. 60",
            crate::process::MAX_WAIT_SECONDS
        ));
    }
    Ok(v)
}

/// Parses a count `>= 1` (`--steps`, `--world-size`, `--micro-batch`, `--seq-len`,
/// `--grad-accum`, `--threads-per-rank`, `--log-every`).
///
/// Errors: the rule and the fix, for clap's message.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number; give an integer >= 1"))?;
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

/// [`at_least_one`] as a `u64`.
///
/// Errors: as [`at_least_one`].
pub fn at_least_one_u64(s: &str) -> Result<u64, String> {
    at_least_one(s).map(|v| v as u64)
}

/// A note when `--warmup` reaches past `--steps`: the learning rate never gets to `--lr`.
pub fn warmup_note(o: &TrainOptions) -> Option<String> {
    (o.warmup > o.steps).then(|| {
        format!(
            "note: --warmup {} is beyond --steps {}: the learning rate rises linearly for the whole \
             run and ends at {:.3e}, below --lr {} (a --warmup of at most {} reaches it)",
            o.warmup,
            o.steps,
            o.lr * o.steps as f64 / o.warmup as f64,
            o.lr,
            o.steps
        )
    })
}

/// A note when shard-optimizer runs with gradient accumulation and `--grad-sync every`: it
/// reduces once per step, after the last micro-batch, so the setting does not apply.
pub fn grad_sync_note(o: &TrainOptions) -> Option<String> {
    (o.strategy == fsdp_planner::Strategy::ShardOptimizer
        && o.grad_accum > 1
        && o.grad_sync == fsdp_planner::GradSync::EveryMicroBatch)
        .then(|| {
            "note: shard-optimizer reduces gradients once per step, after the last micro-batch \
             (its parameters stay replicated through the step), so --grad-sync every does not \
             apply: the run is --grad-sync last"
                .to_string()
        })
}

/// An I/O error in plain words, without the operating system's error number: "does not
/// exist", "permission denied", else the error's own text.
pub fn io_words(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => {
            let t = e.to_string();
            match t.find(" (os error") {
                Some(i) => t[..i].to_string(),
                None => t,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers_refuse_out_of_range_values() {
        assert_eq!(non_negative("0.1"), Ok(0.1));
        assert!(non_negative("-5").unwrap_err().contains(">= 0"));
        assert!(non_negative("nan").is_err());
        assert!(positive("0").unwrap_err().contains("> 0"));
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(at_least_one("0").is_err());
    }
}
