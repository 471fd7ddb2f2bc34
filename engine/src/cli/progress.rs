//! `fsdp train`'s progress without a terminal: a plain line every `--log-every` steps or 30
//! seconds, and a watch on the `--data` file, which training reads whole at the start (a text)
//! or window by window (a token file).

use crate::train::StepReport;
use std::path::PathBuf;

/// The state of the plain (no terminal) progress log and the data-file watch.
pub struct PlainLog {
    every: u64,
    last: std::sync::Mutex<std::time::Instant>,
    data: Option<(PathBuf, (u64, std::time::SystemTime))>,
    /// Whether `data` is a token file (read as training goes, not copied at the start).
    token_file: bool,
    warned: std::sync::atomic::AtomicBool,
}

/// Longest interval between two plain progress lines.
const LOG_SECONDS: f64 = 30.0;

impl PlainLog {
    /// A log of a line every `every` steps (or 30 s) that watches the `--data` file `data`.
    pub fn new(every: u64, data: Option<PathBuf>) -> Self {
        let data = data.and_then(|p| crate::data::file_stamp(&p).map(|st| (p, st)));
        let token_file = data
            .as_ref()
            .is_some_and(|(p, _)| matches!(crate::data::tokens::probe(p), Ok(Some(_))));
        PlainLog {
            every,
            last: std::sync::Mutex::new(std::time::Instant::now()),
            data,
            token_file,
            warned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether step report `r` gets a line: every `every` steps, 30 s after the last line,
    /// the last step, an evaluated or a skipped step.
    pub fn due(&self, r: &StepReport, total: u64) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let due = r.step.is_multiple_of(self.every)
            || r.step == total
            || r.val_loss.is_some()
            || r.skipped
            || last.elapsed().as_secs_f64() >= LOG_SECONDS;
        if due {
            *last = std::time::Instant::now();
        }
        due
    }

    /// Warns once on stderr when the `--data` file changed on disk (truncated, rewritten,
    /// replaced) since the run read it: training goes on with the copy in memory (a text), or
    /// reads on from the file it opened (a token file: a truncated one stops the run).
    pub fn watch_data(&self, step: u64) {
        use std::sync::atomic::Ordering;
        let Some((path, stamp)) = &self.data else {
            return;
        };
        if self.warned.load(Ordering::Relaxed) {
            return;
        }
        let now = crate::data::file_stamp(path);
        if now.as_ref() != Some(stamp) {
            self.warned.store(true, Ordering::Relaxed);
            let size = now.map_or("gone".to_string(), |(n, _)| {
                format!("{} bytes", fsdp_types::group_thousands(n))
            });
            let how = if self.token_file {
                "training reads windows from the file it opened: a file moved over it is not \
                 seen, a truncated one stops the run with an error"
            } else {
                "training continues on the copy read at the start"
            };
            crate::output::errln!(
                "warning: --data {} changed on disk by step {step} (was {} bytes, now {size}); \
                 {how}",
                path.display(),
                fsdp_types::group_thousands(stamp.0)
            );
        }
    }
}

/// One plain progress line (under 100 columns for realistic values): step, loss (and
/// validation loss), learning rate, tokens/s, exposed communication of the step, memory.
pub fn log_line(r: &StepReport, total: u64) -> String {
    let val = r
        .val_loss
        .map(|v| format!(" val {v:.4}"))
        .unwrap_or_default();
    let mem = r.process_bytes.unwrap_or(r.live_bytes);
    let extra = match (r.loss_scale, r.skipped) {
        (_, true) => " | skipped".to_string(),
        (Some(s), false) => format!(" | scale {s}"),
        (None, false) => String::new(),
    };
    format!(
        "step {}/{total} | loss {:.4}{val} | lr {:.1e} | {} tok/s | comm {:.1}/{:.0} ms | mem {}{extra}",
        r.step,
        r.loss,
        r.lr,
        fsdp_types::group_thousands(r.tokens_per_s.round() as u64),
        1e3 * r.comm_exposed_seconds,
        1e3 * r.step_seconds,
        short_bytes(mem)
    )
}

/// Bytes in binary units with one decimal (`45.0 MiB`, `512 B`), for the progress line.
fn short_bytes(b: u64) -> String {
    let s = fsdp_types::Bytes(b).to_string();
    // `Bytes` prints two decimals (`45.00 MiB`): drop the second.
    match s.split_once(' ') {
        Some((num, unit)) if num.contains('.') => format!("{} {unit}", &num[..num.len() - 1]),
        _ => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, skipped: bool) -> StepReport {
        StepReport {
            step,
            loss: 2.345678,
            lr: 9.5e-4,
            grad_norm: None,
            tokens: 4096,
            tokens_per_s: 123456.7,
            step_seconds: 0.0331,
            comm_exposed_seconds: 0.0012,
            loss_scale: skipped.then_some(65536.0),
            skipped,
            nonfinite: None,
            live_bytes: 3 << 20,
            process_bytes: Some(45 << 20),
            val_loss: Some(2.5),
        }
    }

    #[test]
    fn log_line_has_every_field_and_fits_100_columns() {
        let l = log_line(&report(120, false), 10000);
        assert_eq!(
            l,
            "step 120/10000 | loss 2.3457 val 2.5000 | lr 9.5e-4 | 123,457 tok/s | comm 1.2/33 ms \
             | mem 45.0 MiB"
        );
        assert!(l.len() < 100, "{} columns: {l}", l.len());
        let mut skipped = report(7, true);
        skipped.val_loss = None;
        let s = log_line(&skipped, 10000);
        assert!(s.ends_with(" | skipped"), "{s}");
        assert!(s.len() < 100, "{s}");
    }

    #[test]
    fn due_every_n_steps_and_at_the_last() {
        let log = PlainLog::new(10, None);
        let mut r = report(3, false);
        r.val_loss = None;
        assert!(!log.due(&r, 25));
        r.step = 10;
        assert!(log.due(&r, 25));
        r.step = 25;
        assert!(log.due(&r, 25));
        r.step = 11;
        r.skipped = true;
        assert!(log.due(&r, 25));
    }
}
