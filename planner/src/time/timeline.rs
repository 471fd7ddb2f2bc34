//! The event simulation of one rank: a compute thread and a communication thread.
//!
//! The compute thread runs its work in program order. Issuing a collective takes no compute
//! time: the collective joins the communication thread's queue and runs when the ones before
//! it are done (one progress thread per rank, issue order, as `fsdp_comm`'s `progress.rs`);
//! waiting for it blocks the compute thread until it completes (exposed communication).
//! While any collective runs, compute work progresses `1 + overlap_slowdown` times slower
//! (the two share memory bandwidth and cores; on a GPU, SMs and HBM). Collectives are not
//! slowed by compute. The integration is exact (piecewise constant speed), so a result
//! depends only on the inputs.

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
    pub issued: Vec<Issued>,
    pub spans: Vec<Span>,
    pub phase: Phase,
    pub micro_batch: Option<u64>,
}

impl Timeline {
    pub fn new(overlap_slowdown: f64) -> Self {
        Timeline {
            now: 0.0,
            slow: 1.0 + overlap_slowdown,
            comm_free: 0.0,
            first_live: 0,
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
        let start = self.now.max(self.comm_free);
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
    /// exposed communication (a wait span when positive).
    pub fn wait(&mut self, id: usize) {
        let end = self.issued[id].end;
        if end > self.now {
            let start = self.now;
            self.issued[id].exposed += end - start;
            let c = &self.issued[id];
            let name = format!("wait {} {}", c.kind.name(), c.label);
            let unit = c.unit;
            self.push_span(Track::Compute, SpanKind::Wait, name, unit, start, end, None);
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
