//! The TCP rendezvous and torchrun's environment, with threads as ranks and real sockets on
//! 127.0.0.1: the unique id reaches every rank, results come back in rank order, and every
//! failure (missing or bad variable, port in use, a rank that never arrives, world-size
//! disagreement, duplicate rank, rank 0 gone) is an error that says which and how much.

use fsdp_comm::rendezvous::{bind_listener, LaunchEnv, Rendezvous};
use fsdp_comm::CommError;
use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

fn env(rank: usize, world_size: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// A listener on a free port of 127.0.0.1 and its port.
fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = l.local_addr().expect("local addr").port();
    (l, port)
}

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

const FULL: [(&str, &str); 5] = [
    ("RANK", "2"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_RANK", "1"),
    ("MASTER_ADDR", "10.0.0.7"),
    ("MASTER_PORT", "29500"),
];

#[test]
fn torchrun_environment_parses() {
    let e = LaunchEnv::from_lookup(lookup(&FULL)).unwrap();
    assert_eq!(
        e,
        LaunchEnv {
            rank: 2,
            world_size: 4,
            local_rank: 1,
            master_addr: "10.0.0.7".into(),
            master_port: 29500,
        }
    );
    assert_eq!(e.addr(), "10.0.0.7:29500");
    // LOCAL_RANK defaults to RANK.
    let no_local: Vec<_> = FULL
        .iter()
        .copied()
        .filter(|(k, _)| *k != "LOCAL_RANK")
        .collect();
    assert_eq!(
        LaunchEnv::from_lookup(lookup(&no_local))
            .unwrap()
            .local_rank,
        2
    );
}

#[test]
fn missing_and_invalid_variables_are_named() {
    for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        let vars: Vec<_> = FULL
            .iter()
            .copied()
            .filter(|(k, _)| *k != missing)
            .collect();
        match LaunchEnv::from_lookup(lookup(&vars)) {
            Err(CommError::Env {
                name, value: None, ..
            }) => assert_eq!(name, missing),
            other => panic!("{missing} unset: expected Env error, got {other:?}"),
        }
    }
    let cases: [(&str, &str, &str); 6] = [
        ("RANK", "two", "not a non-negative decimal integer"),
        ("RANK", "4", "must be in 0..=3"),
        ("WORLD_SIZE", "0", "must be in 1..="),
        ("LOCAL_RANK", "-1", "not a non-negative decimal integer"),
        ("MASTER_PORT", "70000", "must be in 1..=65535"),
        ("MASTER_ADDR", " ", "empty"),
    ];
    for (name, bad, why) in cases {
        let vars: Vec<_> = FULL
            .iter()
            .map(|&(k, v)| if k == name { (k, bad) } else { (k, v) })
            .collect();
        let e = LaunchEnv::from_lookup(lookup(&vars)).unwrap_err();
        let text = e.to_string();
        match &e {
            CommError::Env {
                name: n,
                value: Some(v),
                reason,
            } => {
                assert_eq!(*n, name);
                assert_eq!(v, bad);
                assert!(reason.contains(why), "{name}={bad}: {text}");
            }
            other => panic!("{name}={bad}: expected Env error, got {other:?}"),
        }
        assert!(text.contains(name), "{text}");
    }
}

#[test]
fn unique_id_reaches_every_rank_and_results_come_back_in_rank_order() {
    let (l, port) = listener();
    let w = 4;
    let id: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(37)).collect();
    let got: Vec<(Vec<u8>, Vec<Vec<u8>>)> = std::thread::scope(|s| {
        let mut hs = Vec::new();
        let id0 = id.clone();
        hs.push(s.spawn(move || {
            let mut rv = Rendezvous::root(l, &env(0, w, port), Duration::from_secs(20)).unwrap();
            let id = rv.broadcast_bytes(Some(&id0)).unwrap();
            let all = rv.all_gather_bytes(&[0u8; 1]).unwrap();
            rv.barrier().unwrap();
            (id, all)
        }));
        for r in 1..w {
            hs.push(s.spawn(move || {
                // Peers arrive one after another.
                std::thread::sleep(Duration::from_millis(30 * r as u64));
                let mut rv = Rendezvous::join(&env(r, w, port), Duration::from_secs(20)).unwrap();
                assert_eq!((rv.rank(), rv.world_size()), (r, w));
                let id = rv.broadcast_bytes(None).unwrap();
                let all = rv.all_gather_bytes(&vec![r as u8; r + 1]).unwrap();
                rv.barrier().unwrap();
                (id, all)
            }));
        }
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want_all: Vec<Vec<u8>> = (0..w).map(|r| vec![r as u8; r + 1]).collect();
    for (r, (gid, all)) in got.iter().enumerate() {
        assert_eq!(gid, &id, "rank {r}'s id");
        assert_eq!(all, &want_all, "rank {r}'s gathered messages");
    }
}

#[test]
fn peers_that_start_before_rank_0_retry_until_it_listens() {
    let (l, port) = listener();
    drop(l); // nothing listens on `port` until rank 0 binds it again below
    std::thread::scope(|s| {
        let peer = s.spawn(move || {
            let mut rv = Rendezvous::join(&env(1, 2, port), Duration::from_secs(20))?;
            rv.broadcast_bytes(None)
        });
        std::thread::sleep(Duration::from_millis(300));
        let l = bind_listener(&env(0, 2, port)).unwrap();
        let mut rv = Rendezvous::root(l, &env(0, 2, port), Duration::from_secs(20)).unwrap();
        rv.broadcast_bytes(Some(b"id")).unwrap();
        assert_eq!(peer.join().unwrap().unwrap(), b"id".to_vec());
    });
}

#[test]
fn port_in_use_is_named() {
    let (l, port) = listener();
    let e = Rendezvous::connect(&env(0, 2, port), Duration::from_secs(1)).unwrap_err();
    let text = e.to_string();
    assert!(matches!(
        e,
        CommError::Rendezvous {
            rank: 0,
            world_size: 2,
            ..
        }
    ));
    assert!(text.contains(&format!("port {port} is in use")), "{text}");
    drop(l);
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() {
    let (l, port) = listener();
    let w = 3;
    let t0 = Instant::now();
    let (root, peer) = std::thread::scope(|s| {
        let root =
            s.spawn(move || Rendezvous::root(l, &env(0, w, port), Duration::from_millis(800)));
        let peer = s.spawn(move || Rendezvous::join(&env(1, w, port), Duration::from_secs(10)));
        (root.join().unwrap(), peer.join().unwrap())
    });
    let took = t0.elapsed();
    let e = root.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("ranks [2] never arrived"), "{text}");
    assert!(text.contains("2 of 3 ranks arrived"), "{text}");
    assert!(
        took < Duration::from_secs(5),
        "rank 0 gave up after {took:?}"
    );
    // The rank that did arrive hears rank 0's reason instead of waiting for its own timeout.
    let pe = peer.unwrap_err().to_string();
    assert!(
        pe.contains("rank 0 refused the world") && pe.contains("ranks [2]"),
        "{pe}"
    );
}

#[test]
fn a_peer_with_no_rank_0_times_out_with_the_last_error() {
    let (l, port) = listener();
    drop(l);
    let t0 = Instant::now();
    let e = Rendezvous::join(&env(1, 2, port), Duration::from_millis(400)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    let text = e.to_string();
    assert!(
        text.contains("cannot reach rank 0 within 0.4 s") && text.contains("last error"),
        "{text}"
    );
    assert!(matches!(
        e,
        CommError::Rendezvous {
            rank: 1,
            world_size: 2,
            ..
        }
    ));
}

#[test]
fn world_size_disagreement_fails_every_rank() {
    let (l, port) = listener();
    let (root, peer) = std::thread::scope(|s| {
        let root = s.spawn(move || Rendezvous::root(l, &env(0, 2, port), Duration::from_secs(10)));
        let peer = s.spawn(move || Rendezvous::join(&env(1, 3, port), Duration::from_secs(10)));
        (root.join().unwrap(), peer.join().unwrap())
    });
    let re = root.unwrap_err().to_string();
    assert!(
        re.contains("world size disagreement: rank 1")
            && re.contains("WORLD_SIZE=3")
            && re.contains("rank 0 expects 2"),
        "{re}"
    );
    let pe = peer.unwrap_err().to_string();
    assert!(
        pe.contains("rank 0 refused the world: world size disagreement"),
        "{pe}"
    );
}

#[test]
fn duplicate_ranks_are_refused() {
    let (l, port) = listener();
    let (root, a, b) = std::thread::scope(|s| {
        let root = s.spawn(move || Rendezvous::root(l, &env(0, 3, port), Duration::from_secs(10)));
        let a = s.spawn(move || Rendezvous::join(&env(1, 3, port), Duration::from_secs(10)));
        let b = s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            Rendezvous::join(&env(1, 3, port), Duration::from_secs(10))
        });
        (root.join().unwrap(), a.join().unwrap(), b.join().unwrap())
    });
    let re = root.unwrap_err().to_string();
    assert!(re.contains("rank 1 arrived twice"), "{re}");
    assert!(a.is_err() && b.is_err());
}

#[test]
fn a_peer_that_exits_is_reported_by_rank() {
    let (l, port) = listener();
    let res = std::thread::scope(|s| {
        let root = s.spawn(move || {
            let mut rv = Rendezvous::root(l, &env(0, 2, port), Duration::from_secs(10)).unwrap();
            rv.all_gather_bytes(b"x")
        });
        let peer = s.spawn(move || {
            let rv = Rendezvous::join(&env(1, 2, port), Duration::from_secs(10)).unwrap();
            drop(rv); // exits without taking part in the exchange
        });
        peer.join().unwrap();
        root.join().unwrap()
    });
    let text = res.unwrap_err().to_string();
    assert!(
        text.contains("no message from rank 1: connection closed by the peer"),
        "{text}"
    );
}

#[test]
fn an_exchange_with_a_silent_peer_times_out() {
    let (l, port) = listener();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let res = std::thread::scope(|s| {
        let root = s.spawn(move || {
            let mut rv = Rendezvous::root(l, &env(0, 2, port), Duration::from_secs(10)).unwrap();
            rv.set_timeout(Duration::from_millis(300));
            let t0 = Instant::now();
            let r = rv.all_gather_bytes(b"x");
            tx.send(()).unwrap();
            (r, t0.elapsed())
        });
        s.spawn(move || {
            let _rv = Rendezvous::join(&env(1, 2, port), Duration::from_secs(10)).unwrap();
            rx.recv().unwrap(); // stays connected and silent until rank 0 gave up
        });
        root.join().unwrap()
    });
    let (r, took) = res;
    let text = r.unwrap_err().to_string();
    assert!(text.contains("no message from rank 1: timed out"), "{text}");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "{took:?}"
    );
}
