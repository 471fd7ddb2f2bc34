//! Checks `fsdp train` makes on its flags before any work: clap value parsers for the
//! hyperparameters (a bad value exits 2 at parse time with the value, the rule and the fix),
//! notes on flag combinations that run but may surprise (warmup past the last step), and the
//! check of the data against a model directory's own tokenizer (`fsdp train --init-from`,
//! `fsdp eval --model-dir`).

use crate::options::TrainOptions;

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
        let eval = if v == 0.0 {
            " (to measure a model's loss without training, use `fsdp eval`)"
        } else {
            ""
        };
        return Err(format!(
            "must be a finite number > 0, got {v}; e.g. 1e-3{eval}"
        ));
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
    let t = s.trim();
    let v: usize = t.parse().map_err(|_| match t.parse::<i128>() {
        Ok(n) if n < 1 => format!("`{s}` must be at least 1"),
        Ok(_) => format!(
            "`{s}` is too large; give an integer from 1 to {}",
            usize::MAX
        ),
        Err(_) => format!("`{s}` is not a whole number; give an integer >= 1"),
    })?;
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

/// Parses a hardware profile's name (`fsdp calibrate --name`): at least one visible
/// character, no control characters (the name heads every prediction's report line).
///
/// Errors: the rule and the fix, for clap's message.
pub fn profile_name(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err(
            "the profile's name is empty; give a name such as `my-host-w2` (or leave \
                    --name out for `calibrated-<host>`)"
                .into(),
        );
    }
    if s.chars().any(char::is_control) {
        return Err(format!(
            "{s:?} holds a control character; give a name of printable characters"
        ));
    }
    Ok(s.to_string())
}

/// Parses a count that may be 0 (`--prefetch`, `--warmup`, `--max-skipped`).
///
/// Errors: the rule and the fix, for clap's message.
pub fn whole_number_u64(s: &str) -> Result<u64, String> {
    let t = s.trim();
    t.parse().map_err(|_| match t.parse::<i128>() {
        Ok(n) if n < 0 => format!("`{s}` is negative; give a whole number >= 0"),
        Ok(_) => format!("`{s}` is too large; give a whole number up to {}", u64::MAX),
        Err(_) => format!("`{s}` is not a whole number; give an integer >= 0"),
    })
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

/// The `tokenizer.json` of the model directory `dir`, when it holds one.
pub fn model_tokenizer(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let t = dir.join("tokenizer.json");
    (dir.is_dir() && t.is_file()).then_some(t)
}

/// The first 12 hex digits of a SHA-256, as messages show it.
pub fn short_sha(hex: &str) -> &str {
    &hex[..hex.len().min(12)]
}

/// Checks the data fed to the model of directory `dir` (named by `model_flag`, e.g.
/// `--init-from DIR`) against the model's own tokenizer, `dir/tokenizer.json`: a token file
/// must have been made with it (the header's SHA-256 of the tokenizer file's bytes, as `fsdp
/// data tokenize` records it, against the SHA-256 of this file's bytes), and text or no data
/// (bytes as token ids 0-255) is refused. `allow` (`--allow-tokenizer-mismatch`) turns a
/// refusal into a note. Nothing is checked when the directory holds no tokenizer or the data
/// cannot be read (the run's own error names that).
///
/// Returns a note to print, if any.
///
/// Errors: [`super::CliError::Usage`] naming the data, both tokenizers (short SHA-256) and the
/// `fsdp data tokenize` command that makes the right token file.
pub fn check_data_tokenizer(
    model_flag: &str,
    dir: &std::path::Path,
    data: Option<&std::path::Path>,
    allow: bool,
) -> Result<Option<String>, super::CliError> {
    let Some(tok) = model_tokenizer(dir) else {
        return Ok(None);
    };
    let tokenize = |text: &str, out: &str| {
        format!(
            "`fsdp data tokenize --tokenizer {} {text} -o {out}`",
            tok.display()
        )
    };
    let problem = match data {
        None => format!(
            "{model_flag} holds the model's tokenizer ({}) but no --data was given: the \
             built-in corpus would be fed as byte ids 0-255, which are not this model's tokens. \
             Tokenize your text with the model's tokenizer, {}, and pass --data tokens.bin",
            tok.display(),
            tokenize("TEXT.txt", "tokens.bin")
        ),
        Some(p) => match crate::data::tokens::probe(p) {
            Err(_) => return Ok(None),
            // A path that cannot be read is the run's own error to name.
            Ok(None) if std::fs::metadata(p).is_err() => return Ok(None),
            Ok(None) => {
                let mut out = p.with_extension("bin");
                if out == p {
                    out = p.with_extension("tokens.bin");
                }
                format!(
                    "--data {} is text, fed as byte ids 0-255, but the model of {model_flag} reads \
                     the token ids of its tokenizer ({}). Tokenize it first, {}, and pass --data {}",
                    p.display(),
                    tok.display(),
                    tokenize(&p.display().to_string(), &out.display().to_string()),
                    out.display()
                )
            }
            Ok(Some(h)) => {
                let sha = crate::data::tokens::sha256_file(&tok).map_err(|e| {
                    super::CliError::Usage(format!("{}: cannot read it: {e}", tok.display()))
                })?;
                if h.tokenizer_sha256 == sha {
                    return Ok(None);
                }
                if h.tokenizer_sha256 == [0; 32] {
                    return Ok(Some(format!(
                        "note: --data {} records no tokenizer: it cannot be checked against {}",
                        p.display(),
                        tok.display()
                    )));
                }
                let now = crate::data::tokens::hex(&sha);
                format!(
                    "--data {} was made with another tokenizer (sha256 {}..) than the model's {} \
                     (sha256 {}..): its token ids name other pieces of text than the ones the \
                     model learned (the hashes are of the tokenizer.json bytes: the same \
                     tokenizer saved in another layout differs too). Tokenize the text again \
                     with the model's tokenizer, {}",
                    p.display(),
                    short_sha(&h.tokenizer_hex()),
                    tok.display(),
                    short_sha(&now),
                    tokenize("TEXT.txt", &p.display().to_string())
                )
            }
        },
    };
    if allow {
        Ok(Some(format!("note: --allow-tokenizer-mismatch: {problem}")))
    } else {
        Err(super::CliError::Usage(format!(
            "{problem} (or pass --allow-tokenizer-mismatch to go on anyway)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_say_why_a_value_is_refused() {
        assert_eq!(at_least_one(" 3 "), Ok(3));
        assert_eq!(at_least_one("0"), Err("must be at least 1".to_string()));
        assert_eq!(
            at_least_one("-1"),
            Err("`-1` must be at least 1".to_string())
        );
        assert_eq!(
            at_least_one("abc"),
            Err("`abc` is not a whole number; give an integer >= 1".to_string())
        );
        assert!(at_least_one("99999999999999999999999")
            .unwrap_err()
            .contains("is too large"));
    }

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
