//! Where this process sits in a data-parallel job, read from the launcher's environment:
//! torchrun's variables (what `transponder launch` sets), else Open MPI's (`mpirun`), else
//! Slurm's (`srun`). Open MPI comes before Slurm because `mpirun` inside an `sbatch` script
//! inherits the batch step's `SLURM_PROCID=0` in every rank.

use anyhow::{bail, Context, Result};

/// Where this process sits in a data-parallel job, from the launcher's environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many processes (one per GPU) take part.
    pub world_size: usize,
    /// This process's rank on its node (the GPU ordinal to use).
    pub local_rank: usize,
    /// How many processes run on this node.
    pub local_world_size: usize,
    /// The host rank 0 listens on for the rendezvous.
    pub master_addr: String,
    /// The port rank 0 listens on for the rendezvous.
    pub master_port: u16,
}

/// torchrun's contract, which `transponder launch` sets too.
const TORCHRUN: [&str; 4] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
/// `mpirun`'s (Open MPI) variables, in the same order.
const OPEN_MPI: [&str; 4] =
    ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"];
/// `srun`'s variables: rank, world size, local rank (the local size is read apart).
const SLURM: [&str; 3] = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];

impl World {
    /// torchrun's contract: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT; fallbacks OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (mpirun) and
    /// SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with SLURM_NTASKS_PER_NODE or
    /// SLURM_TASKS_PER_NODE (srun); MASTER_ADDR and MASTER_PORT are required with every
    /// launcher. `Ok(None)` when none is set (a single process); an error naming the variable
    /// for a partial or invalid set.
    pub fn from_env() -> Result<Option<World>> {
        World::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`World::from_env`] over `lookup` (a variable's value, `None` when unset).
    fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<World>> {
        let (launcher, [rank, world_size, local_rank, local_world_size]) =
            if TORCHRUN.iter().any(|v| lookup(v).is_some()) {
                ("torchrun / transponder launch", read_all(&lookup, TORCHRUN)?)
            } else if OPEN_MPI.iter().any(|v| lookup(v).is_some()) {
                ("mpirun", read_all(&lookup, OPEN_MPI)?)
            } else if SLURM.iter().any(|v| lookup(v).is_some()) {
                let [rank, world_size, local_rank] = read_all(&lookup, SLURM)?;
                // A single task (`srun -n 1`, or a command run in an sbatch script itself) trains alone.
                if world_size == 1 && lookup("MASTER_ADDR").is_none() {
                    return Ok(None);
                }
                ("srun", [rank, world_size, local_rank, slurm_local_size(&lookup)?])
            } else {
                return Ok(None);
            };
        if world_size == 0 {
            bail!("the world size is 0 ({launcher}'s variables): a job needs at least one rank");
        }
        if rank >= world_size {
            bail!("rank {rank} is out of range for world size {world_size} ({launcher}'s variables)");
        }
        if local_world_size == 0 || local_world_size > world_size {
            bail!("local world size {local_world_size} is out of range for world size {world_size} ({launcher}'s variables)");
        }
        if local_rank >= local_world_size {
            bail!("local rank {local_rank} is out of range for local world size {local_world_size} ({launcher}'s variables)");
        }
        let needed = |name: &str| {
            lookup(name).filter(|v| !v.trim().is_empty()).with_context(|| {
                format!(
                    "{name} is not set: {launcher} says this is rank {rank} of {world_size}, and every rank needs \
                     MASTER_ADDR and MASTER_PORT (the host and port rank 0 listens on for the rendezvous)"
                )
            })
        };
        let master_addr = needed("MASTER_ADDR")?.trim().to_string();
        let port = needed("MASTER_PORT")?;
        let master_port = match port.trim().parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => bail!("MASTER_PORT={port:?} is not a port number (1 to 65535)"),
        };
        Ok(Some(World { rank, world_size, local_rank, local_world_size, master_addr, master_port }))
    }

    /// Whether this is rank 0: the rendezvous host, the one that logs and saves.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// Every one of `names` as a count, or an error naming the missing and malformed ones.
fn read_all<const N: usize>(lookup: &impl Fn(&str) -> Option<String>, names: [&str; N]) -> Result<[usize; N]> {
    let missing: Vec<&str> = names.iter().copied().filter(|name| lookup(name).is_none()).collect();
    if !missing.is_empty() {
        let set: Vec<&str> = names.iter().copied().filter(|name| lookup(name).is_some()).collect();
        bail!(
            "{} set but {} not: a launcher sets all of {} (unset them all to train in one process)",
            set.join(", "),
            missing.join(", "),
            names.join(", ")
        );
    }
    let mut values = [0; N];
    for (value, name) in values.iter_mut().zip(names) {
        *value = parse_count(name, &lookup(name).unwrap_or_default())?;
    }
    Ok(values)
}

fn parse_count(name: &str, value: &str) -> Result<usize> {
    value.trim().parse().with_context(|| format!("{name}={value:?} is not a non-negative whole number"))
}

/// Tasks on this node under srun: SLURM_NTASKS_PER_NODE, else the first count of
/// SLURM_TASKS_PER_NODE (`"4(x2),3"` → 4; srun runs this node's tasks under that count).
fn slurm_local_size(lookup: &impl Fn(&str) -> Option<String>) -> Result<usize> {
    if let Some(value) = lookup("SLURM_NTASKS_PER_NODE") {
        return parse_count("SLURM_NTASKS_PER_NODE", &value);
    }
    let value = lookup("SLURM_TASKS_PER_NODE").context(
        "srun's SLURM_PROCID is set but neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE: \
         pass --ntasks-per-node to srun",
    )?;
    let first = value.split([',', '(']).next().unwrap_or_default();
    parse_count("SLURM_TASKS_PER_NODE", first)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        World::from_lookup(|name| map.get(name).cloned())
    }

    fn error(vars: &[(&str, &str)]) -> String {
        format!("{:#}", world(vars).expect_err("an error"))
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29501")];

    fn torchrun(rank: &str, size: &str, local: &str, local_size: &str) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", rank.into()),
            ("WORLD_SIZE", size.into()),
            ("LOCAL_RANK", local.into()),
            ("LOCAL_WORLD_SIZE", local_size.into()),
        ]
    }

    fn with_master<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
        vars.iter().map(|(k, v)| (*k, v.as_str())).chain(MASTER).collect()
    }

    #[test]
    fn the_full_torchrun_set_is_read() {
        let vars = torchrun("3", "4", "1", "2");
        let got = world(&with_master(&vars)).unwrap().unwrap();
        let want = World {
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29501,
        };
        assert_eq!(got, want);
        assert!(!got.is_leader());
    }

    #[test]
    fn no_variables_is_a_single_process() {
        assert_eq!(world(&[]).unwrap(), None);
        assert_eq!(world(&MASTER).unwrap(), None, "MASTER_* alone launch nothing");
    }

    #[test]
    fn a_partial_set_names_what_is_missing() {
        let message = error(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(message.contains("RANK, WORLD_SIZE set but LOCAL_RANK, LOCAL_WORLD_SIZE not"), "{message}");
        let vars = torchrun("0", "2", "0", "2");
        let message = error(&vars.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
        assert!(message.contains("MASTER_ADDR is not set") && message.contains("rank 0 of 2"), "{message}");
        let message = error(&[&with_master(&vars)[..5], &[("MASTER_PORT", " ")]].concat());
        assert!(message.contains("MASTER_PORT is not set"), "{message}");
    }

    #[test]
    fn invalid_values_are_named() {
        let cases = [
            (torchrun("2", "2", "0", "1"), "rank 2 is out of range for world size 2"),
            (torchrun("0", "0", "0", "1"), "the world size is 0"),
            (torchrun("0", "2", "1", "1"), "local rank 1 is out of range for local world size 1"),
            (torchrun("0", "2", "0", "3"), "local world size 3 is out of range for world size 2"),
            (torchrun("-1", "2", "0", "1"), "RANK=\"-1\" is not a non-negative whole number"),
            (torchrun("one", "2", "0", "1"), "RANK=\"one\""),
        ];
        for (vars, want) in cases {
            let message = error(&with_master(&vars));
            assert!(message.contains(want), "{message} lacks {want}");
        }
        let vars = torchrun("0", "2", "0", "2");
        for port in ["0", "65536", "http"] {
            let message = error(&[&with_master(&vars)[..5], &[("MASTER_PORT", port)]].concat());
            assert!(message.contains(&format!("MASTER_PORT={port:?} is not a port number")), "{message}");
        }
    }

    #[test]
    fn open_mpi_is_read_and_wins_over_the_batch_steps_slurm_variables() {
        let vars = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ];
        let got = world(&[&vars[..], &MASTER].concat()).unwrap().unwrap();
        assert_eq!((got.rank, got.world_size, got.local_rank, got.local_world_size), (1, 2, 1, 2));
        let message = error(&[("OMPI_COMM_WORLD_RANK", "1")]);
        assert!(message.contains("OMPI_COMM_WORLD_RANK set but OMPI_COMM_WORLD_SIZE"), "{message}");
    }

    #[test]
    fn slurm_is_read_with_its_local_size() {
        let vars =
            [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "4(x2)")];
        let got = world(&[&vars[..], &MASTER].concat()).unwrap().unwrap();
        assert_eq!((got.rank, got.world_size, got.local_rank, got.local_world_size), (5, 8, 1, 4));
        let per_node = [&vars[..3], &[("SLURM_NTASKS_PER_NODE", "2")], &MASTER].concat();
        assert_eq!(world(&per_node).unwrap().unwrap().local_world_size, 2);
        let message = error(&vars);
        assert!(message.contains("MASTER_ADDR is not set: srun says this is rank 5 of 8"), "{message}");
        let message = error(&[&vars[..3], &MASTER].concat());
        assert!(message.contains("neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE"), "{message}");
    }

    #[test]
    fn a_single_slurm_task_without_master_trains_alone() {
        let vars = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_LOCALID", "0")];
        assert_eq!(world(&vars).unwrap(), None);
    }
}
