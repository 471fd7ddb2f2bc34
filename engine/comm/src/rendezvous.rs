//! Process bootstrap: torchrun's environment and a small TCP rendezvous on
//! `MASTER_ADDR:MASTER_PORT` that hands every rank rank 0's bytes (the NCCL unique id).
//!
//! One job: before a multi-process communicator exists, the processes of one job must find each
//! other, agree on the world size and share one opaque value (NCCL's 128-byte `ncclUniqueId`,
//! created by rank 0 with `ncclGetUniqueId`; NCCL then builds its own connections from it, see
//! the NCCL user guide, "Creating a communicator with options" / `ncclCommInitRank`). This module
//! does only that, with the standard library's `std::net` and no CUDA, so it builds and is
//! tested everywhere.
//!
//! - [`LaunchEnv`]: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, the names
//!   `torchrun` (PyTorch's elastic launcher) and `fsdp launch` export to each process.
//! - [`Rendezvous`]: rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects
//!   (retrying until the deadline, since rank 0 may start last) and sends a hello carrying its
//!   rank and the world size it expects. Rank 0 answers once all `W - 1` peers arrived, or sends
//!   every connected peer the error (world-size disagreement, duplicate or out-of-range rank, a
//!   rank that never arrived). The connections stay open: [`Rendezvous::broadcast_bytes`] and
//!   [`Rendezvous::all_gather_bytes`] move small host messages over the star (rank 0 relays),
//!   which the NCCL backend uses to share unique ids and the multi-process conformance launcher
//!   to exchange per-rank results.
//!
//! Wire format: every message is a frame `u64 length (little endian) + bytes`. The hello is
//! `b"FSDPRDV1" + u64 rank + u64 world size`; the answer is `u8 status (0 ok, 1 error) + text`.
//! Every read and write has a deadline; a peer that closes its socket is reported by rank.

use crate::error::CommError;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The default rendezvous timeout (how long rank 0 waits for every peer, and a peer for rank 0).
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);

/// The first bytes of a hello; a connection that does not start with them is not ours.
const MAGIC: &[u8; 8] = b"FSDPRDV1";

/// Largest frame accepted (bytes): the messages are unique ids and conformance results.
const MAX_FRAME: u64 = 1 << 30;

/// The per-process launch environment, as exported by `torchrun` and `fsdp launch`.
///
/// `rank` is the global rank (`0 <= rank < world_size`), `local_rank` the rank within its node
/// (the CUDA device ordinal the process uses), `master_addr:master_port` where rank 0 listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, from `RANK`.
    pub rank: usize,
    /// Number of processes, from `WORLD_SIZE` (>= 1).
    pub world_size: usize,
    /// Rank within the node, from `LOCAL_RANK` (defaults to `rank` when unset); selects the GPU.
    pub local_rank: usize,
    /// Host name or IP address of rank 0, from `MASTER_ADDR`.
    pub master_addr: String,
    /// TCP port rank 0 listens on, from `MASTER_PORT` (1..=65535).
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the process environment (see [`LaunchEnv::from_lookup`]).
    ///
    /// Errors: [`CommError::Env`] naming the first missing or invalid variable.
    pub fn from_env() -> Result<LaunchEnv, CommError> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Builds the environment from `lookup` (a variable name to its value). `RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are required; `LOCAL_RANK` defaults to
    /// `RANK`. Numbers are decimal; `WORLD_SIZE >= 1`, `RANK < WORLD_SIZE`, `LOCAL_RANK <
    /// WORLD_SIZE`, `MASTER_PORT` in 1..=65535, `MASTER_ADDR` non-empty.
    ///
    /// Errors: [`CommError::Env`] with the variable, its value and what is wrong.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, CommError> {
        fn number(
            name: &'static str,
            v: Option<String>,
            min: usize,
            max: usize,
        ) -> Result<usize, CommError> {
            let raw = v.ok_or_else(|| CommError::Env {
                name,
                value: None,
                reason: "not set (set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun \
                         does, or start the processes with `fsdp launch`)"
                    .into(),
            })?;
            let x: usize = raw.trim().parse().map_err(|_| CommError::Env {
                name,
                value: Some(raw.clone()),
                reason: "not a non-negative decimal integer".into(),
            })?;
            if x < min || x > max {
                return Err(CommError::Env {
                    name,
                    value: Some(raw),
                    reason: format!("must be in {min}..={max}"),
                });
            }
            Ok(x)
        }
        let world_size = number("WORLD_SIZE", lookup("WORLD_SIZE"), 1, u32::MAX as usize)?;
        let rank = number("RANK", lookup("RANK"), 0, world_size - 1)?;
        let local_rank = match lookup("LOCAL_RANK") {
            None => rank,
            v => number("LOCAL_RANK", v, 0, world_size - 1)?,
        };
        let master_addr = match lookup("MASTER_ADDR") {
            None => {
                return Err(CommError::Env {
                    name: "MASTER_ADDR",
                    value: None,
                    reason: "not set (the host name or IP address of rank 0)".into(),
                })
            }
            Some(a) if a.trim().is_empty() => {
                return Err(CommError::Env {
                    name: "MASTER_ADDR",
                    value: Some(a),
                    reason: "empty".into(),
                })
            }
            Some(a) => a.trim().to_string(),
        };
        let master_port = number("MASTER_PORT", lookup("MASTER_PORT"), 1, 65535)? as u16;
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT` (IPv6 literals in brackets).
    pub fn addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// An established rendezvous: rank 0 holds one connection per other rank, every other rank one
/// connection to rank 0 (a star). Created by [`Rendezvous::connect`] (or [`Rendezvous::root`] /
/// [`Rendezvous::join`]); messages over it are collective: every rank calls the same methods
/// in the same order.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    addr: String,
    timeout: Duration,
    /// Rank 0: the streams of ranks `1..W` (index `r - 1`). Other ranks: one stream to rank 0.
    links: Vec<TcpStream>,
}

impl Rendezvous {
    /// Rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects; returns when all
    /// `WORLD_SIZE` ranks arrived with the same world size. `timeout` bounds the whole
    /// rendezvous and, later, every message.
    ///
    /// Errors: [`CommError::Rendezvous`]: the port is in use or cannot be bound (rank 0), rank 0
    /// cannot be reached in time, ranks that never arrived (named), world-size disagreement,
    /// duplicate or out-of-range ranks, a connection closed.
    pub fn connect(env: &LaunchEnv, timeout: Duration) -> Result<Rendezvous, CommError> {
        if env.rank == 0 {
            let listener = bind_listener(env)?;
            Rendezvous::root(listener, env, timeout)
        } else {
            Rendezvous::join(env, timeout)
        }
    }

    /// Rank 0's side on an already bound `listener` (tests bind port 0 and hand its port to the
    /// peers). Waits until ranks `1..W` said hello, each at most once and with world size
    /// `env.world_size`; then answers each `ok`.
    ///
    /// Errors: as [`Rendezvous::connect`]; on any error every connected peer is sent the text.
    pub fn root(
        listener: TcpListener,
        env: &LaunchEnv,
        timeout: Duration,
    ) -> Result<Rendezvous, CommError> {
        let deadline = Instant::now() + timeout;
        let w = env.world_size;
        let addr = env.addr();
        let err = |reason: String| CommError::Rendezvous {
            addr: addr.clone(),
            rank: 0,
            world_size: w,
            reason,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| err(format!("cannot poll the listener: {e}")))?;
        let mut peers: Vec<Option<TcpStream>> = (1..w).map(|_| None).collect();
        let mut failure: Option<String> = None;
        let mut stray: Vec<TcpStream> = Vec::new();
        while failure.is_none() && peers.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut s, from)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_nodelay(true);
                    match read_hello(&mut s, deadline) {
                        Ok((r, their_w)) => {
                            if their_w != w {
                                failure = Some(format!(
                                    "world size disagreement: rank {r} (from {from}) expects \
                                     WORLD_SIZE={their_w}, rank 0 expects {w}"
                                ));
                                stray.push(s);
                            } else if r == 0 || r >= w {
                                failure = Some(format!(
                                    "a process from {from} says it is rank {r}, outside 1..{w}"
                                ));
                                stray.push(s);
                            } else if peers[r - 1].is_some() {
                                failure = Some(format!(
                                    "rank {r} arrived twice (second from {from}): two processes \
                                     have RANK={r}"
                                ));
                                stray.push(s);
                            } else {
                                peers[r - 1] = Some(s);
                            }
                        }
                        Err(why) => {
                            // Not one of ours (a port scanner, a stale client): drop it.
                            let _ = why;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| i + 1)
                            .collect();
                        failure = Some(format!(
                            "ranks {missing:?} never arrived within {:.1} s ({} of {w} ranks \
                             arrived)",
                            timeout.as_secs_f64(),
                            w - missing.len()
                        ));
                    } else {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                Err(e) => failure = Some(format!("accept failed: {e}")),
            }
        }
        let mut streams: Vec<TcpStream> = peers.into_iter().flatten().collect();
        if let Some(reason) = failure {
            for s in streams.iter_mut().chain(stray.iter_mut()) {
                let _ = write_answer(s, Err(&reason), deadline);
            }
            return Err(err(reason));
        }
        for (i, s) in streams.iter_mut().enumerate() {
            write_answer(s, Ok(()), deadline)
                .map_err(|e| err(format!("cannot answer rank {}: {e}", i + 1)))?;
        }
        Ok(Rendezvous {
            rank: 0,
            world_size: w,
            addr,
            timeout,
            links: streams,
        })
    }

    /// A non-zero rank's side: connects to rank 0 (retrying every 20 ms until the deadline, as
    /// rank 0 may not listen yet), says hello, waits for the answer.
    ///
    /// Errors: as [`Rendezvous::connect`]; rank 0's error text when rank 0 refused the world.
    pub fn join(env: &LaunchEnv, timeout: Duration) -> Result<Rendezvous, CommError> {
        let deadline = Instant::now() + timeout;
        let addr = env.addr();
        let err = |reason: String| CommError::Rendezvous {
            addr: addr.clone(),
            rank: env.rank,
            world_size: env.world_size,
            reason,
        };
        let mut last;
        let mut stream = loop {
            match resolve(&addr) {
                Ok(sa) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(1))) {
                        Ok(s) => break s,
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                return Err(err(format!(
                    "cannot reach rank 0 within {:.1} s (last error: {last})",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = stream.set_nodelay(true);
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(env.rank as u64).to_le_bytes());
        hello.extend_from_slice(&(env.world_size as u64).to_le_bytes());
        write_frame(&mut stream, &hello, deadline)
            .map_err(|e| err(format!("cannot send the hello to rank 0: {e}")))?;
        let answer = read_frame(&mut stream, deadline).map_err(|e| {
            err(format!(
                "no answer from rank 0 (it waits for all {} ranks): {e}",
                env.world_size
            ))
        })?;
        match answer.split_first() {
            Some((0, _)) => Ok(Rendezvous {
                rank: env.rank,
                world_size: env.world_size,
                addr,
                timeout,
                links: vec![stream],
            }),
            Some((_, text)) => Err(err(format!(
                "rank 0 refused the world: {}",
                String::from_utf8_lossy(text)
            ))),
            None => Err(err("empty answer from rank 0".into())),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `MASTER_ADDR:MASTER_PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The per-message timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the per-message timeout of later calls.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn err(&self, reason: String) -> CommError {
        CommError::Rendezvous {
            addr: self.addr.clone(),
            rank: self.rank,
            world_size: self.world_size,
            reason,
        }
    }

    /// Rank 0's `payload` to every rank (collective; ranks other than 0 pass `None`, rank 0
    /// `Some`). Returns the payload on every rank. Used for the NCCL unique id (128 bytes).
    ///
    /// Errors: [`CommError::Rendezvous`]: rank 0 passed `None` or another rank `Some`, a peer
    /// closed its connection or did not answer within the timeout (named by rank).
    pub fn broadcast_bytes(&mut self, payload: Option<&[u8]>) -> Result<Vec<u8>, CommError> {
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            let p = payload.ok_or_else(|| self.err("rank 0 must supply the payload".into()))?;
            for i in 0..self.links.len() {
                let r = write_frame(&mut self.links[i], p, deadline);
                r.map_err(|e| self.err(format!("cannot send to rank {}: {e}", i + 1)))?;
            }
            Ok(p.to_vec())
        } else {
            if payload.is_some() {
                return Err(self.err(format!(
                    "only rank 0 supplies the payload, rank {} did too",
                    self.rank
                )));
            }
            let r = read_frame(&mut self.links[0], deadline);
            r.map_err(|e| self.err(format!("no payload from rank 0: {e}")))
        }
    }

    /// Every rank's `mine`, in rank order, on every rank (collective): ranks send theirs to rank
    /// 0, rank 0 sends the whole list back. Sizes may differ per rank.
    ///
    /// Errors: [`CommError::Rendezvous`] naming the rank whose connection closed or timed out.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for i in 0..self.links.len() {
                let r = read_frame(&mut self.links[i], deadline);
                all.push(r.map_err(|e| self.err(format!("no message from rank {}: {e}", i + 1)))?);
            }
            let packed = pack(&all);
            for i in 0..self.links.len() {
                let r = write_frame(&mut self.links[i], &packed, deadline);
                r.map_err(|e| self.err(format!("cannot send to rank {}: {e}", i + 1)))?;
            }
            Ok(all)
        } else {
            write_frame(&mut self.links[0], mine, deadline)
                .map_err(|e| self.err(format!("cannot send to rank 0: {e}")))?;
            let packed = read_frame(&mut self.links[0], deadline)
                .map_err(|e| self.err(format!("no answer from rank 0: {e}")))?;
            let all =
                unpack(&packed).ok_or_else(|| self.err("malformed answer from rank 0".into()))?;
            if all.len() != self.world_size {
                return Err(self.err(format!(
                    "rank 0 sent {} messages, expected {}",
                    all.len(),
                    self.world_size
                )));
            }
            Ok(all)
        }
    }

    /// Returns once every rank called `barrier` (an [`Rendezvous::all_gather_bytes`] of nothing).
    ///
    /// Errors: as [`Rendezvous::all_gather_bytes`].
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.all_gather_bytes(&[]).map(|_| ())
    }
}

/// Binds rank 0's listener on `MASTER_ADDR:MASTER_PORT` (every address `MASTER_ADDR` resolves
/// to is tried in order).
///
/// Errors: [`CommError::Rendezvous`]: the port is in use (named), the address does not resolve
/// or is not local.
pub fn bind_listener(env: &LaunchEnv) -> Result<TcpListener, CommError> {
    let addr = env.addr();
    let err = |reason: String| CommError::Rendezvous {
        addr: addr.clone(),
        rank: env.rank,
        world_size: env.world_size,
        reason,
    };
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| err(format!("MASTER_ADDR does not resolve: {e}")))?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((a, e)),
        }
    }
    match last {
        Some((a, e)) if e.kind() == ErrorKind::AddrInUse => Err(err(format!(
            "port {} is in use on {a} (another job or a previous run still holds it; pick \
             another MASTER_PORT / --master-port)",
            env.master_port
        ))),
        Some((a, e)) => Err(err(format!("cannot listen on {a}: {e}"))),
        None => Err(err("MASTER_ADDR resolves to no address".into())),
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, String> {
    addr.to_socket_addrs()
        .map_err(|e| format!("MASTER_ADDR does not resolve: {e}"))?
        .next()
        .ok_or_else(|| "MASTER_ADDR resolves to no address".to_string())
}

fn left(deadline: Instant) -> std::io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        Err(std::io::Error::new(ErrorKind::TimedOut, "timed out"))
    } else {
        Ok(d)
    }
}

fn io_text(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "timed out".into(),
        ErrorKind::UnexpectedEof => "connection closed by the peer".into(),
        _ => e.to_string(),
    }
}

fn write_frame(s: &mut TcpStream, bytes: &[u8], deadline: Instant) -> Result<(), String> {
    let mut run = || -> std::io::Result<()> {
        s.set_write_timeout(Some(left(deadline)?))?;
        let mut msg = Vec::with_capacity(8 + bytes.len());
        msg.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        msg.extend_from_slice(bytes);
        s.write_all(&msg)?;
        s.flush()
    };
    run().map_err(|e| io_text(&e))
}

fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.set_read_timeout(Some(left(deadline)?))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_frame(s: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, String> {
    let mut len = [0u8; 8];
    read_exact_by(s, &mut len, deadline).map_err(|e| io_text(&e))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_FRAME {
        return Err(format!(
            "frame of {n} bytes exceeds the {MAX_FRAME}-byte limit"
        ));
    }
    let mut buf = vec![0u8; n as usize];
    read_exact_by(s, &mut buf, deadline).map_err(|e| io_text(&e))?;
    Ok(buf)
}

fn read_hello(s: &mut TcpStream, deadline: Instant) -> Result<(usize, usize), String> {
    // A hello must come quickly once connected; do not let a silent client eat the deadline.
    let quick = deadline.min(Instant::now() + Duration::from_secs(10));
    let h = read_frame(s, quick)?;
    if h.len() != 24 || &h[..8] != MAGIC {
        return Err("not a rendezvous hello".into());
    }
    let rank = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let world = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    Ok((rank as usize, world as usize))
}

fn write_answer(s: &mut TcpStream, r: Result<(), &str>, deadline: Instant) -> Result<(), String> {
    let deadline = deadline.max(Instant::now() + Duration::from_secs(1));
    let msg: Vec<u8> = match r {
        Ok(()) => vec![0],
        Err(text) => std::iter::once(1u8).chain(text.bytes()).collect(),
    };
    write_frame(s, &msg, deadline)
}

fn pack(all: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (all.len() as u64).to_le_bytes().to_vec();
    for m in all {
        out.extend_from_slice(&(m.len() as u64).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

fn unpack(mut b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        b = t;
        Some(h)
    };
    let count = u64::from_le_bytes(take(8)?.try_into().ok()?) as usize;
    let mut out = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let n = u64::from_le_bytes(take(8)?.try_into().ok()?) as usize;
        out.push(take(n)?.to_vec());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trips_and_rejects_truncation() {
        let all = vec![vec![1u8, 2, 3], vec![], vec![9u8; 300]];
        let p = pack(&all);
        assert_eq!(unpack(&p), Some(all));
        assert_eq!(unpack(&p[..p.len() - 1]), None);
    }

    #[test]
    fn ipv6_addresses_are_bracketed() {
        let e = LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "::1".into(),
            master_port: 29500,
        };
        assert_eq!(e.addr(), "[::1]:29500");
    }
}
