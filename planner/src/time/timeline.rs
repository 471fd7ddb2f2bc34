//! The event simulation of one rank: a compute thread and a communication thread.
//!
//! The compute thread runs its work in program order. Issuing a collective takes no compute
//! time: the collective joins the communication thread's queue and runs when the ones before
//! it are done (one progress thread per rank, issue order, as `fsdp_comm`'s `progress.rs`);
//! waiting for it blocks the compute thread until it completes (exposed communication).
//! While any collective runs, compute work progresses `1 + overlap_slowdown` times slower
//! (the two share memory bandwidth and cores; on a GPU, SMs and HBM). Collectives are not
//! slowed by compute.
//!
//! Rank skew (the profile's `rank_skew`, `k`): the simulated rank is the mean rank, and the
//! slowest rank's compute takes `1 + k` times as long. The simulation keeps how far the
//! slowest rank is behind the simulated one at the current point of the program (`lag`,
//! grown by `k` times every compute span): a collective starts only when the slowest rank
//! issues it (`lag` after the simulated rank), and a wait that blocks the simulated rank
//! until the collective ends brings the two together again (the lag left is what the
//! slowest rank still had to compute when the collective ended, often 0). At the end of the
//! step the simulated rank waits out what is left ([`Timeline::finish`]: the next step's
//! first collective). A wait's first `lag` seconds are counted as waiting for the slowest
//! rank, the rest as the collective's exposed time.
//!
//! The integration is exact (piecewise constant speed), so a result depends only on the
//! inputs.

use super::{CollectiveKind, GroupKind, Span, SpanKind, Track};
use crate::memory::Phase;

/// One issued collective.
#[derive(Debug, Clone)]
pub(super) struct Issued {
    pub kind: CollectiveKind,
    pub group: GroupKind,
    pub unit: Option<usize>,
    pub label: String,
    pub bytes: f64,
    pub start: f64,
    pub end: f64,
    /// Seconds the compute thread waited for it.
    pub exposed: f64,
}

/// The state of the simulation.
pub(super) struct Timeline {
    now: f64,
    slow: f64,
    comm_free: f64,
    first_live: usize,
    skew: f64,
    lag: f64,
    /// Seconds the compute thread waited for the slowest rank (see the module doc).
    pub skew_wait: f64,
    pub issued: Vec<Issued>,
    pub spans: Vec<Span>,
    pub phase: Phase,
    pub micro_batch: Option<u64>,
}

impl Timeline {
    /// A timeline whose compute runs `1 + overlap_slowdown` slower while a collective runs
    /// and whose slowest rank computes `1 + rank_skew` times as long (0 on one rank).
    pub fn new(overlap_slowdown: f64, rank_skew: f64) -> Self {
        Timeline {
            now: 0.0,
            slow: 1.0 + overlap_slowdown,
            comm_free: 0.0,
            first_live: 0,
            skew: rank_skew,
            lag: 0.0,
            skew_wait: 0.0,
            issued: Vec::new(),
            spans: Vec::new(),
            phase: Phase::Forward,
            micro_batch: None,
        }
    }

    /// The compute thread's clock.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Runs `work` seconds of full-speed compute on the compute thread, slowed while
    /// collectives run; records a span (none for zero work).
    pub fn compute(&mut self, work: f64, kind: SpanKind, name: String, unit: Option<usize>) {
        if work <= 0.0 {
            return;
        }
        let start = self.now;
        let mut t = start;
        let mut rem = work;
        while self.first_live < self.issued.len() && self.issued[self.first_live].end <= t {
            self.first_live += 1;
        }
        let mut i = self.first_live;
        loop {
            let Some(c) = self.issued.get(i) else {
                t += rem;
                break;
            };
            let (s, e) = (c.start, c.end);
            if t < s {
                let free = s - t;
                if rem <= free {
                    t += rem;
                    break;
                }
                rem -= free;
                t = s;
            }
            if t < e {
                let cap = (e - t) / self.slow;
                if rem <= cap {
                    t += rem * self.slow;
                    break;
                }
                rem -= cap;
                t = e;
            }
            i += 1;
        }
        self.now = t;
        self.lag += self.skew * (t - start);
        self.push_span(Track::Compute, kind, name, unit, start, t, None);
    }

    /// Issues a collective of `seconds` on the communication thread; returns its id.
    #[allow(clippy::too_many_arguments)]
    pub fn issue(
        &mut self,
        kind: CollectiveKind,
        group: GroupKind,
        unit: Option<usize>,
        label: String,
        bytes: f64,
        seconds: f64,
    ) -> usize {
        // It starts when its last rank, the slowest, has issued it.
        let start = (self.now + self.lag).max(self.comm_free);
        let end = start + seconds;
        self.comm_free = end;
        let name = format!("{} {label}", kind.name());
        self.push_span(
            Track::Communication,
            kind.span_kind(),
            name,
            unit,
            start,
            end,
            Some(bytes),
        );
        self.issued.push(Issued {
            kind,
            group,
            unit,
            label,
            bytes,
            start,
            end,
            exposed: 0.0,
        });
        self.issued.len() - 1
    }

    /// Blocks the compute thread until collective `id` completes; the blocked time is its
    /// exposed communication, its first `lag` seconds the wait for the slowest rank (a span
    /// `wait for the slowest rank (...)`), the rest the collective's own (`wait ...`).
    pub fn wait(&mut self, id: usize) {
        let end = self.issued[id].end;
        if end > self.now {
            let start = self.now;
            let skew = (end - start).min(self.lag);
            self.skew_wait += skew;
            self.issued[id].exposed += end - start - skew;
            self.lag = (start + self.lag - end).max(0.0);
            let c = &self.issued[id];
            let what = format!("{} {}", c.kind.name(), c.label);
            let unit = c.unit;
            // Two spans: the wait for the slowest rank, then the collective's own.
            if skew > 0.0 {
                let name = format!("wait for the slowest rank ({what})");
                let mid = start + skew;
                self.push_span(Track::Compute, SpanKind::Wait, name, unit, start, mid, None);
            }
            if end - start > skew {
                let name = format!("wait {what}");
                let mid = start + skew;
                self.push_span(Track::Compute, SpanKind::Wait, name, unit, mid, end, None);
            }
            self.now = end;
        }
    }

    /// Ends the step: the simulated rank waits for the slowest rank to finish its step (the
    /// next step's first collective), a wait span when the lag is positive.
    pub fn finish(&mut self) {
        if self.lag > 0.0 {
            let (start, end) = (self.now, self.now + self.lag);
            self.skew_wait += self.lag;
            self.lag = 0.0;
            let name = "wait for the slowest rank".to_string();
            self.push_span(Track::Compute, SpanKind::Wait, name, None, start, end, None);
            self.now = end;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push_span(
        &mut self,
        track: Track,
        kind: SpanKind,
        name: String,
        unit: Option<usize>,
        start: f64,
        end: f64,
        bytes: Option<f64>,
    ) {
        self.spans.push(Span {
            track,
            kind,
            name,
            unit,
            micro_batch: self.micro_batch,
            phase: self.phase,
            start_s: start,
            end_s: end,
            bytes,
        });
    }
}
