//! A process's place in a distributed run, from the variables launchers set.
//!
//! kiln reads what PyTorch's `torchrun` sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), falling back to Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`) for `srun`, so the same binary runs under `torchrun --no-python`, `srun`,
//! or kiln's own launcher (the `launch` module).
//!
//! The rendezvous port: rank 0 of kiln listens on `MASTER_PORT` — except under `torchrun`, whose
//! agent already serves its own store there (it sets `TORCHELASTIC_USE_AGENT_STORE` and
//! `TORCHELASTIC_RUN_ID` in the workers' environment); kiln then uses `MASTER_PORT + 1`.
//! `KILN_RDZV_PORT` overrides both.

use std::time::Duration;

use kiln_core::{DistErrorKind, Error, Result};

/// The variables that disable NVLink multicast (NVLS) in NCCL, PyTorch's symmetric memory and
/// NVSHMEM: kiln's launcher sets them for every process it starts, and
/// [`DistEnv::apply_nvls_off`] sets them in the current process when they are missing.
pub const NVLS_OFF: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// Where this process stands in a distributed run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The process's index on its machine (which GPU it uses).
    pub local_rank: usize,
    pub master_addr: String,
    /// The port of kiln's rendezvous (see the module docs).
    pub rdzv_port: u16,
    /// How long to wait for the rendezvous and for each collective (`KILN_DIST_TIMEOUT_S`).
    pub timeout: Duration,
}

/// The default timeout, in seconds, and the parser of `KILN_DIST_TIMEOUT_S` (one definition in
/// kiln-core, shared with the NCCL communicator of `kiln_backend_cuda::nccl`).
pub use kiln_core::env::{
    DEFAULT_DIST_TIMEOUT_S as DEFAULT_TIMEOUT_S, parse_dist_timeout as parse_timeout,
};

fn env_err(var: &str, msg: impl std::fmt::Display) -> Error {
    Error::dist(
        "DistEnv",
        DistErrorKind::Environment,
        format!("{var}: {msg}"),
    )
}

impl DistEnv {
    /// Reads the process environment (see the module docs). `Ok(None)` when neither `RANK`/
    /// `WORLD_SIZE` nor Slurm's variables are set: a single-process run.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::from_env`] over any lookup (for tests and launchers).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let parse = |var: &str| -> Result<Option<usize>> {
            match get(var) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| env_err(var, format!("`{v}` is not a non-negative integer"))),
            }
        };
        let (rank, world, local) = match (parse("RANK")?, parse("WORLD_SIZE")?) {
            (Some(r), Some(w)) => (r, w, parse("LOCAL_RANK")?),
            (None, None) => match (parse("SLURM_PROCID")?, parse("SLURM_NTASKS")?) {
                (Some(r), Some(w)) => (r, w, parse("SLURM_LOCALID")?),
                _ => return Ok(None),
            },
            (Some(_), None) => {
                return Err(env_err("WORLD_SIZE", "RANK is set but WORLD_SIZE is not"));
            }
            (None, Some(_)) => return Err(env_err("RANK", "WORLD_SIZE is set but RANK is not")),
        };
        if world == 0 {
            return Err(env_err("WORLD_SIZE", "must be at least 1"));
        }
        if rank >= world {
            return Err(env_err(
                "RANK",
                format!("rank {rank} is not below WORLD_SIZE {world}"),
            ));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port_of = |var: &str, v: String| -> Result<u16> {
            v.trim()
                .parse::<u16>()
                .map_err(|_| env_err(var, format!("`{v}` is not a port number")))
        };
        let rdzv_port = match get("KILN_RDZV_PORT") {
            Some(v) => port_of("KILN_RDZV_PORT", v)?,
            None => {
                let p = match get("MASTER_PORT") {
                    Some(v) => port_of("MASTER_PORT", v)?,
                    None => 29500,
                };
                let torchrun = get("TORCHELASTIC_USE_AGENT_STORE").is_some()
                    || get("TORCHELASTIC_RUN_ID").is_some();
                if torchrun {
                    p.checked_add(1)
                        .ok_or_else(|| env_err("MASTER_PORT", "no port above it for kiln"))?
                } else {
                    p
                }
            }
        };
        let timeout = parse_timeout(get("KILN_DIST_TIMEOUT_S").as_deref())?;
        Ok(Some(DistEnv {
            rank,
            world_size: world,
            local_rank: local.unwrap_or(rank),
            master_addr,
            rdzv_port,
            timeout,
        }))
    }

    /// Sets [`NVLS_OFF`] in this process's environment where missing, before any library
    /// that reads them (NCCL) is initialized. Call it at the start of `main`, before threads.
    pub fn apply_nvls_off() {
        for (k, v) in NVLS_OFF {
            if std::env::var_os(k).is_none() {
                // SAFETY: called at start-up, before other threads read the environment
                // (documented requirement of this function).
                unsafe { std::env::set_var(k, v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn look(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_style() {
        let e = DistEnv::from_lookup(look(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("KILN_DIST_TIMEOUT_S", "7.5"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 1,
                world_size: 2,
                local_rank: 1,
                master_addr: "10.0.0.1".into(),
                rdzv_port: 1234,
                timeout: Duration::from_millis(7500),
            }
        );
    }

    #[test]
    fn under_torchrun_the_port_above_master_port() {
        let e = DistEnv::from_lookup(look(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.rdzv_port, 29501);
        assert_eq!(e.local_rank, 0);
        assert_eq!(e.master_addr, "127.0.0.1");
        let e = DistEnv::from_lookup(look(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "x"),
            ("KILN_RDZV_PORT", "4000"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(e.rdzv_port, 4000);
    }

    #[test]
    fn slurm_fallback_and_single_process() {
        let e = DistEnv::from_lookup(look(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, 1));
        assert_eq!(DistEnv::from_lookup(look(&[])).unwrap(), None);
    }

    #[test]
    fn errors_name_the_variable() {
        for (pairs, var) in [
            (&[("RANK", "0")][..], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")][..], "RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")][..], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")][..], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")][..],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("KILN_DIST_TIMEOUT_S", "-3"),
                ][..],
                "KILN_DIST_TIMEOUT_S",
            ),
        ] {
            let e = DistEnv::from_lookup(look(pairs)).unwrap_err();
            assert_eq!(e.dist_kind(), Some(DistErrorKind::Environment), "{e}");
            assert!(e.to_string().contains(var), "{var}: {e}");
        }
    }
}
