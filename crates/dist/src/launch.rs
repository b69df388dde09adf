//! kiln's launcher: one process per GPU on this machine, like `torchrun --nproc_per_node N`.
//!
//! [`launch`] starts `nproc` copies of a program with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set, plus [`NVLS_OFF`] (NVLink multicast
//! off in NCCL, PyTorch and NVSHMEM), and waits for them. When one fails (non-zero exit or a
//! signal), the others get a grace period to notice and exit with their own error (the
//! rendezvous links and NCCL's watchdog make them do so), then the launcher kills those still
//! running. The result names the first rank that failed and how.

use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use kiln_core::{DistErrorKind, Error, Result};

use crate::env::NVLS_OFF;

/// How [`launch`] starts the processes.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    pub nproc: usize,
    pub master_addr: String,
    /// `None`: a free port of this machine.
    pub master_port: Option<u16>,
    /// How long survivors may take to exit on their own after a rank failed
    /// (`KILN_LAUNCH_GRACE_S`, default 30 s) before they are killed.
    pub grace: Duration,
    /// Extra variables for every process.
    pub env: Vec<(String, String)>,
}

impl LaunchConfig {
    pub fn new(nproc: usize) -> Self {
        let grace = std::env::var("KILN_LAUNCH_GRACE_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .unwrap_or(30.0);
        LaunchConfig {
            nproc,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            grace: Duration::from_secs_f64(grace),
            env: Vec::new(),
        }
    }
}

fn launch_err(msg: impl std::fmt::Display) -> Error {
    Error::dist("launch", DistErrorKind::PeerLost, msg)
}

/// A free TCP port of this machine (bound and released; another process could take it in
/// between, which the rendezvous then reports).
pub fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| launch_err(format!("no free port: {e}")))
}

fn describe(s: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match s.code() {
        Some(c) => format!("exited with status {c}"),
        None => "ended abnormally".into(),
    }
}

/// The environment of rank `rank` (see the module docs).
pub fn rank_env(cfg: &LaunchConfig, port: u16, rank: usize) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        ("RANK".into(), rank.to_string()),
        ("LOCAL_RANK".into(), rank.to_string()),
        ("WORLD_SIZE".into(), cfg.nproc.to_string()),
        ("LOCAL_WORLD_SIZE".into(), cfg.nproc.to_string()),
        ("MASTER_ADDR".into(), cfg.master_addr.clone()),
        ("MASTER_PORT".into(), port.to_string()),
    ];
    env.extend(NVLS_OFF.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.extend(cfg.env.iter().cloned());
    env
}

/// Runs `program args` once per rank and waits (see the module docs). `Ok` when every rank
/// exited with status 0.
pub fn launch(program: &Path, args: &[String], cfg: &LaunchConfig) -> Result<()> {
    if cfg.nproc == 0 {
        return Err(Error::invalid("launch", "nproc must be at least 1"));
    }
    let port = match cfg.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let mut children: Vec<Option<Child>> = Vec::new();
    for rank in 0..cfg.nproc {
        let mut cmd = Command::new(program);
        cmd.args(args);
        // A launcher's own place must not leak into its children (torchrun's, Slurm's).
        for k in [
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID",
            "KILN_RDZV_PORT",
        ] {
            cmd.env_remove(k);
        }
        cmd.envs(rank_env(cfg, port, rank));
        match cmd.spawn() {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(launch_err(format!(
                    "could not start rank {rank} ({}): {e}",
                    program.display()
                )));
            }
        }
    }
    let mut failure: Option<(usize, String, Instant)> = None;
    loop {
        let mut running = 0;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *slot = None;
                    if !st.success() && failure.is_none() {
                        eprintln!(
                            "kiln launch: rank {rank} {}; stopping the others",
                            describe(st)
                        );
                        failure = Some((rank, describe(st), Instant::now()));
                    }
                }
                Ok(None) => running += 1,
                Err(e) => {
                    *slot = None;
                    failure.get_or_insert((
                        rank,
                        format!("could not be waited for: {e}"),
                        Instant::now(),
                    ));
                }
            }
        }
        if running == 0 {
            break;
        }
        if let Some((_, _, at)) = &failure
            && at.elapsed() > cfg.grace
        {
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(c) = slot {
                    eprintln!(
                        "kiln launch: killing rank {rank} (still running {:.0} s after the failure)",
                        cfg.grace.as_secs_f64()
                    );
                    let _ = c.kill();
                    let _ = c.wait();
                    *slot = None;
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failure {
        None => Ok(()),
        Some((rank, how, _)) => Err(launch_err(format!("rank {rank} of {} {how}", cfg.nproc))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_its_place_and_nvls_off() {
        let cfg = LaunchConfig::new(2);
        let env = rank_env(&cfg, 1234, 1);
        let get = |k: &str| env.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("1"));
        assert_eq!(get("WORLD_SIZE"), Some("2"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("MASTER_PORT"), Some("1234"));
        assert_eq!(get("NCCL_NVLS_ENABLE"), Some("0"));
        assert_eq!(get("TORCH_SYMM_MEM_DISABLE_MULTICAST"), Some("1"));
        assert_eq!(get("NVSHMEM_DISABLE_NVLS"), Some("1"));
    }

    #[cfg(unix)]
    #[test]
    fn a_failing_rank_ends_the_others() {
        // Rank 1 fails at once; rank 0 would sleep for a minute: it is killed after the grace.
        let mut cfg = LaunchConfig::new(2);
        cfg.grace = Duration::from_millis(300);
        let t = Instant::now();
        let e = launch(
            Path::new("sh"),
            &[
                "-c".into(),
                r#"if [ "$RANK" = 1 ]; then exit 3; else sleep 60; fi"#.into(),
            ],
            &cfg,
        )
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(
            e.to_string().contains("rank 1 of 2 exited with status 3"),
            "{e}"
        );
        launch(Path::new("sh"), &["-c".into(), "exit 0".into()], &cfg).unwrap();
    }
}
