//! Checks `fsdp train` makes on its flags before any work: clap value parsers for the
//! hyperparameters (a bad value exits 2 at parse time with the value, the rule and the fix),
//! the compute-thread cap, notes on flag combinations that run but may surprise (warmup past
//! the last step), and what a resume changes when the run's data or batch shape differs from
//! the checkpoint's.

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
    if !(v.is_finite() && v > 0.0 && v <= super::train::MAX_WAIT_SECONDS) {
        return Err(format!(
            "must be a number of seconds in (0, {:e}], got {v}; e.g. 60",
            super::train::MAX_WAIT_SECONDS
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

/// CPU cores this process may run on (`available_parallelism`, 1 where unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The compute threads per rank for `ranks` ranks on this node of `cores` cores, and a
/// warning when `requested` (`--threads-per-rank`) had to be lowered: more threads than cores
/// make every rank's pool spin and wait for cores the others hold (64 threads at W = 2 on 2
/// cores ran a step 9x slower than 1 thread). The cap is `max(1, cores / ranks)`, the
/// default's value. `None` requested is the default (no warning).
pub fn cap_threads(
    requested: Option<usize>,
    ranks: usize,
    cores: usize,
) -> (Option<usize>, Option<String>) {
    let fair = (cores / ranks.max(1)).max(1);
    match requested {
        Some(t) if t.saturating_mul(ranks.max(1)) > cores.max(1) && t > fair => (
            Some(fair),
            Some(format!(
                "warning: --threads-per-rank {t} x {ranks} rank(s) = {} compute threads on {cores} \
                 core(s) would oversubscribe them (each rank's pool spins waiting for cores); \
                 using {fair} per rank (at most cores / ranks)",
                fsdp_types::group_thousands(t.saturating_mul(ranks) as u64)
            )),
        ),
        other => (other, None),
    }
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

/// What a resume changes, given the checkpoint's saved flags (`extra`, the manifest's
/// `train.extra`), its world size `saved_world` and completed `step`, against the run's
/// options: one line per changed setting (the data file, the tokenizer of a token file,
/// `--seq-len`, `--micro-batch`, `--grad-accum`, the world size), with where this run's sample
/// stream starts against where the checkpoint's stopped (samples skipped or seen twice). Empty
/// when nothing changes.
pub fn resume_changes(
    extra: &std::collections::BTreeMap<String, String>,
    saved_world: u64,
    step: u64,
    o: &TrainOptions,
) -> Vec<String> {
    let mut lines = Vec::new();
    let data_now = o
        .data
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(embedded corpus)".into());
    let get = |k: &str| extra.get(k).cloned();
    let num = |k: &str| get(k).and_then(|v| v.parse::<u64>().ok());
    if let Some(was) = get("data").filter(|w| *w != data_now) {
        lines.push(format!(
            "--data {data_now} (the checkpoint trained on {was}): the sample stream is cut from \
             the new text, so steps from {} see other windows than an uninterrupted run",
            step + 1
        ));
    }
    let tokens_now = data_extra(o);
    let tokenizer_now = tokens_now.get(DATA_TOKENIZER_KEY);
    match (get(DATA_TOKENIZER_KEY), tokenizer_now) {
        (Some(was), Some(now)) if was != *now => lines.push(format!(
            "a token file made with another tokenizer (sha256 {}.., the checkpoint's {}..): \
             its token ids name other pieces of text than the ones the model learned",
            &now[..now.len().min(12)],
            &was[..was.len().min(12)]
        )),
        (Some(_), None) => lines.push(
            "text as bytes (the checkpoint trained on a token file): byte values are read \
             as the token ids the model learned"
                .into(),
        ),
        (None, Some(_)) if get("data").is_some() => lines.push(
            "a token file (the checkpoint trained on text as bytes): its token ids are not \
             the byte values the model learned"
                .into(),
        ),
        _ => {}
    }
    // The model's math beyond its shapes (rotary base, norm epsilon, scaling, window): the
    // checkpoint's shapes were checked, these are not in them.
    let cfg_now = o
        .hf_config
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok());
    if let (Some(was), Some(now)) = (get(super::ckpt::HF_CONFIG_KEY), cfg_now) {
        let parse = |t: &str| fsdp_planner::hf::parse_llama_numerics(t, "config.json").ok();
        if let (Some(a), Some(b)) = (parse(&was), parse(&now)) {
            if a != b {
                lines.push(format!(
                    "--hf-config {} computes another model than the checkpoint's config.json \
                     (rms_norm_eps {} was {}, rope_theta {} was {}, rope_scaling {} was {}, \
                     sliding_window {:?} was {:?}): the same weights give other outputs",
                    o.hf_config
                        .as_ref()
                        .map_or(String::new(), |p| p.display().to_string()),
                    b.rms_norm_eps,
                    a.rms_norm_eps,
                    b.rope_theta,
                    a.rope_theta,
                    b.rope_scaling
                        .map_or("none".into(), |s| format!("llama3 x{}", s.factor)),
                    a.rope_scaling
                        .map_or("none".into(), |s| format!("llama3 x{}", s.factor)),
                    b.sliding_window,
                    a.sliding_window
                ));
            }
        }
    }
    let seq_now = o.seq_len as u64;
    if let Some(was) = num("seq_len").filter(|w| *w != seq_now) {
        lines.push(format!(
            "--seq-len {seq_now} (the checkpoint used {was}): the text is re-cut into windows of \
             {} bytes, so the window order differs from step {} on",
            seq_now + 1,
            step + 1
        ));
    }
    let (mb_was, ga_was) = (num("micro_batch"), num("grad_accum"));
    let (mb_now, ga_now, w_now) = (
        o.micro_batch as u64,
        o.grad_accum as u64,
        o.world_size as u64,
    );
    let mut shape = Vec::new();
    if let Some(was) = mb_was.filter(|w| *w != mb_now) {
        shape.push(format!("--micro-batch {mb_now} (was {was})"));
    }
    if let Some(was) = ga_was.filter(|w| *w != ga_now) {
        shape.push(format!("--grad-accum {ga_now} (was {was})"));
    }
    if saved_world != w_now {
        shape.push(format!("world size {w_now} (was {saved_world})"));
    }
    if !shape.is_empty() {
        let per_step_was = mb_was
            .unwrap_or(mb_now)
            .saturating_mul(ga_was.unwrap_or(ga_now))
            .saturating_mul(saved_world);
        let per_step_now = mb_now.saturating_mul(ga_now).saturating_mul(w_now);
        let consumed = step.saturating_mul(per_step_was);
        let start = step.saturating_mul(per_step_now);
        let g = fsdp_types::group_thousands;
        let effect = match start.cmp(&consumed) {
            std::cmp::Ordering::Greater => format!(
                "sequences {}..{} of the stream are skipped",
                g(consumed),
                g(start)
            ),
            std::cmp::Ordering::Less => format!(
                "sequences {}..{} of the stream are seen a second time",
                g(start),
                g(consumed)
            ),
            std::cmp::Ordering::Equal => "no sequence is skipped or repeated".into(),
        };
        lines.push(format!(
            "{}: {} sequences per step (was {}); the checkpoint consumed {} sequences \
             ({step} steps), this run starts at sequence {}: {effect}",
            shape.join(", "),
            g(per_step_now),
            g(per_step_was),
            g(consumed),
            g(start)
        ));
    }
    lines
}

/// The checkpoint key recording the SHA-256 of the tokenizer a token file `--data` was made
/// with (64 hex digits, from the file's header).
pub const DATA_TOKENIZER_KEY: &str = "data_tokenizer_sha256";

/// What the checkpoint records about a token file `--data` (empty for text): its tokenizer
/// hash ([`DATA_TOKENIZER_KEY`]), token count (`data_tokens`) and vocabulary size
/// (`data_vocab_size`), from the header. Text and the embedded corpus record nothing here.
pub fn data_extra(o: &TrainOptions) -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    if let Some(h) = o
        .data
        .as_deref()
        .and_then(|p| crate::data::tokens::probe(p).ok().flatten())
    {
        m.insert(DATA_TOKENIZER_KEY.to_string(), h.tokenizer_hex());
        m.insert("data_tokens".to_string(), h.count.to_string());
        m.insert("data_vocab_size".to_string(), h.vocab_size.to_string());
    }
    m
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

    #[test]
    fn threads_are_capped_at_cores_over_ranks() {
        assert_eq!(cap_threads(Some(1000), 2, 2).0, Some(1));
        assert!(cap_threads(Some(1000), 2, 2).1.unwrap().contains("2,000"));
        assert_eq!(cap_threads(Some(4), 2, 8), (Some(4), None));
        assert_eq!(cap_threads(None, 2, 2), (None, None));
        // One thread per rank is never lowered, even with more ranks than cores.
        assert_eq!(cap_threads(Some(1), 4, 2), (Some(1), None));
    }

    #[test]
    fn resume_changes_name_other_model_math() {
        let t = tempfile::tempdir().unwrap();
        let cfg = |theta: &str| {
            format!(
                r#"{{"model_type":"llama","vocab_size":256,"hidden_size":32,
                "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":2,
                "rope_theta":{theta}}}"#
            )
        };
        let mut extra = std::collections::BTreeMap::new();
        extra.insert(
            super::super::ckpt::HF_CONFIG_KEY.to_string(),
            cfg("10000.0"),
        );
        let p = t.path().join("config.json");
        std::fs::write(&p, cfg("10000.0")).unwrap();
        let o = TrainOptions {
            hf_config: Some(p.clone()),
            ..TrainOptions::default()
        };
        assert!(resume_changes(&extra, 1, 5, &o).is_empty());
        std::fs::write(&p, cfg("1234.0")).unwrap();
        let l = resume_changes(&extra, 1, 5, &o);
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(l[0].contains("rope_theta 1234 was 10000"), "{l:?}");
    }

    #[test]
    fn resume_changes_count_skipped_sequences() {
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("micro_batch".to_string(), "8".to_string());
        extra.insert("grad_accum".to_string(), "1".to_string());
        extra.insert("seq_len".to_string(), "128".to_string());
        extra.insert("data".to_string(), "(embedded corpus)".to_string());
        let o = TrainOptions {
            micro_batch: 16,
            seq_len: 128,
            world_size: 1,
            ..TrainOptions::default()
        };
        let l = resume_changes(&extra, 1, 20, &o);
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].contains("sequences 160..320 of the stream are skipped"),
            "{l:?}"
        );
        let same = TrainOptions {
            micro_batch: 8,
            ..o
        };
        assert!(resume_changes(&extra, 1, 20, &same).is_empty());
    }

    #[test]
    fn resume_changes_name_another_tokenizer() {
        use crate::data::tokens::TokenWriter;
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, sha: u8| {
            let p = dir.path().join(name);
            let mut w = TokenWriter::create(&p, 500, [sha; 32]).unwrap();
            w.push(&[1, 2, 3]).unwrap();
            w.finish().unwrap();
            p
        };
        let (a, b) = (file("a.bin", 0xaa), file("b.bin", 0xbb));
        let on = |p: &std::path::Path| TrainOptions {
            data: Some(p.to_path_buf()),
            ..TrainOptions::default()
        };
        let saved = data_extra(&on(&a));
        assert_eq!(saved[DATA_TOKENIZER_KEY], "aa".repeat(32));
        assert_eq!(saved["data_tokens"], "3");
        assert_eq!(saved["data_vocab_size"], "500");
        let mut extra = saved.clone();
        extra.insert("data".into(), a.display().to_string());
        assert!(resume_changes(&extra, 1, 5, &on(&a)).is_empty());
        // The same path rewritten by another tokenizer.
        std::fs::copy(&b, &a).unwrap();
        let l = resume_changes(&extra, 1, 5, &on(&a));
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].contains(
                "another tokenizer (sha256 bbbbbbbbbbbb.., the checkpoint's aaaaaaaaaaaa..)"
            ),
            "{l:?}"
        );
        // Text after a token file.
        let text = dir.path().join("t.txt");
        std::fs::write(&text, "text").unwrap();
        let l = resume_changes(&extra, 1, 5, &on(&text));
        assert!(l.iter().any(|x| x.starts_with("text as bytes")), "{l:?}");
    }
}
