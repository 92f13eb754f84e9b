//! Data-parallel training: `W` processes (ranks), one device each, one model each, trained
//! as one run over a global batch of `W × B × A` sequences.
//!
//! Every rank holds the same parameters and optimizer state. Per step, each rank runs its `A`
//! micro-batches of `B` rows (its shard of the one sampled stream, [`crate::data::Shard`]),
//! each loss scaled by `1 / (A·W)`; then **one** all-reduce (sum) of a flat buffer holding
//! every gradient and the rank's summed loss. After it every rank has the same gradients and
//! the same loss, so the gradient norm, clipping, the divergence decision and the update are
//! the same everywhere, and the parameters stay identical without a broadcast (checked: a
//! hash of the parameters is compared across ranks at start and at every save).
//!
//! The all-reduce runs on NCCL for GPU tensors (`kernels::cuda::nccl`; on the emulated device,
//! its emulation) and on the host collective over TCP for CPU tensors
//! (`kernels::collective`). Rank 0 alone writes the checkpoint, `config.json` and
//! `metrics.jsonl`; a save refused on rank 0 stops every rank (they agree on its outcome through
//! a collective). A rank that dies or hangs stops the others: through the control channel the
//! rendezvous left open ([`crate::dist::ControlChannel`]), through the host collective's read
//! deadline, or through the watchdog ([`crate::dist::Watchdog`]) for a collective that cannot
//! time out by itself (NCCL spins on a dead peer).

use std::net::{IpAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use kernels::collective::{HostComm, ReduceOp, UniqueId};
use nn::NamedParameter;
use tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::dist::{rendezvous, ControlChannel, Watchdog, World};
use crate::fingerprint::{fnv1a_64, fnv1a_64_update, FNV_OFFSET_BASIS};

/// One rank's part in a data-parallel run: its place, its communicator, and the channel and
/// watchdog that stop it when another rank fails.
pub(crate) struct DataParallel {
    world: World,
    comm: Communicator,
    control: ControlChannel,
    watchdog: Watchdog,
    fault: Option<Fault>,
}

/// What runs the collectives: NCCL for GPU tensors, the host collective for CPU tensors.
enum Communicator {
    Host(HostComm),
    #[cfg(feature = "nccl")]
    Nccl {
        comm: kernels::cuda::nccl::NcclComm,
        device: std::sync::Arc<kernels::cuda::CudaDevice>,
    },
}

impl DataParallel {
    /// Joins the run of `world`: the rendezvous (world size, ranks and `config` checked
    /// against rank 0's), then the communicator for `config.device`.
    pub fn join(world: World, config: &TrainConfig) -> Result<DataParallel> {
        let master = master_ip(&world)?;
        let collective_timeout = Duration::from_secs(config.collective_timeout);
        let device = config.device;
        let make_id = || -> Result<[u8; 128]> { Ok(new_unique_id(device, master)?.to_bytes()) };
        let (id, control) =
            rendezvous(&world, config_fingerprint(config)?, Duration::from_secs(config.rendezvous_timeout), make_id)?;
        let id = UniqueId::from_bytes(id);
        let comm = match device {
            Device::Cpu => Communicator::Host(
                HostComm::init(&id, world.rank, world.world_size, collective_timeout)
                    .context("joining the host collective")?,
            ),
            Device::Cuda(ordinal) => nccl_communicator(ordinal, &id, &world, collective_timeout)?,
        };
        let poll = comm.async_error_poll();
        // The host collective's own read deadline names the silent peer; its watchdog is the
        // backstop. NCCL cannot time out: the watchdog is its deadline.
        let watchdog_timeout = match comm {
            Communicator::Host(_) => collective_timeout + Duration::from_secs(10),
            #[cfg(feature = "nccl")]
            Communicator::Nccl { .. } => collective_timeout,
        };
        let watchdog = Watchdog::start(watchdog_timeout, control.notifier(), poll);
        let fault = Fault::from_env(world.rank)?;
        Ok(DataParallel { world, comm, control, watchdog, fault })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.world.rank
    }

    /// The control channel's record of the run's checkpoint and step, for the messages of a
    /// failure (set at start).
    pub fn set_progress(&self, step: usize, checkpoint: &std::path::Path) {
        self.control.set_step(step);
        self.control.set_checkpoint(checkpoint);
    }

    /// The control channel's record of the step in progress.
    pub fn set_step(&self, step: usize) {
        self.control.set_step(step);
    }

    /// Tells the other ranks that this one stops with `message` (it exits next).
    pub fn report_failure(self, message: &str) {
        drop(self.watchdog);
        self.control.report_failure(message);
    }

    /// Sums every rank's gradients of `parameters` and `loss_sum` (this rank's summed
    /// micro-batch losses, a one-element tensor) in one all-reduce; each gradient becomes its
    /// slice of the reduced buffer. Returns the loss summed over every rank.
    pub fn all_reduce_gradients(
        &mut self,
        parameters: &[NamedParameter],
        loss_sum: &Tensor,
        step: usize,
    ) -> Result<f32> {
        if let Some(fault) = self.fault {
            fault.before_all_reduce(step);
        }
        let grads: Vec<(&NamedParameter, Tensor)> =
            parameters.iter().filter_map(|p| p.var.grad().map(|g| (p, g))).collect();
        let flat_parts: Vec<Tensor> = grads
            .iter()
            .map(|(_, g)| g.reshape(&[g.numel()]))
            .chain(std::iter::once(loss_sum.reshape(&[1])))
            .collect::<tensor::Result<_>>()?;
        let mut flat = Tensor::cat(&flat_parts.iter().collect::<Vec<_>>(), 0)?;
        drop(flat_parts);
        let total = flat.numel();
        let loss = {
            // Armed until the host has the result: on a GPU the reduction is only queued.
            let _in_flight = self.watchdog.arm("gradient all-reduce", step);
            // A peer that dies can break this collective before the control channel's stop
            // reaches this rank: the error then says which step failed and how to go on.
            self.comm.all_reduce(&mut flat, ReduceOp::Sum).with_context(|| {
                format!("all-reducing the gradients of step {step} ({})", self.control.notifier().checkpoint_text())
            })?;
            flat.narrow(0, total - 1, 1)?.to_host()?.item()?
        };
        let mut offset = 0;
        for (param, grad) in &grads {
            let n = grad.numel();
            param.var.set_grad(Some(flat.narrow(0, offset, n)?.reshape(grad.shape())?));
            offset += n;
        }
        Ok(loss)
    }

    /// Stops the run when the parameters differ across ranks (they never should: every rank
    /// applies the same update to the same values). Checked at start and at every save.
    pub fn check_parameters(&mut self, parameters: &[NamedParameter], step: usize) -> Result<()> {
        let hash = parameter_hash(parameters)?;
        let pieces: Vec<f32> = (0..4).map(|i| ((hash >> (16 * i)) & 0xffff) as f32).collect();
        let gathered = self.all_gather_host(&pieces, step)?;
        let hash_of =
            |rank: usize| -> u64 { (0..4).map(|i| (gathered[rank * 4 + i] as u64) << (16 * i)).fold(0, |a, b| a | b) };
        let differing: Vec<String> = (1..self.world.world_size)
            .filter(|&rank| hash_of(rank) != hash_of(0))
            .map(|rank| format!("rank {rank} ({:016x})", hash_of(rank)))
            .collect();
        if !differing.is_empty() {
            bail!(
                "the parameters differ across ranks after step {step}: {} against rank 0's {:016x}; stopping \
                 (every rank applies the same update, so this is a bug or a fault on those ranks)",
                differing.join(", "),
                hash_of(0)
            );
        }
        Ok(())
    }

    /// Whether every rank's `ok` holds (a save that rank 0 alone performs, say): all agree,
    /// so a failure on one rank stops all of them at the same step.
    pub fn all_ok(&mut self, ok: bool, step: usize) -> Result<bool> {
        let flags = self.all_gather_host(&[if ok { 0.0 } else { 1.0 }], step)?;
        Ok(flags.iter().all(|&f| f == 0.0))
    }

    /// The test-only fault of this rank, applied after the update of `step`.
    pub fn after_update(&self, parameters: &[NamedParameter], step: usize) -> Result<()> {
        match self.fault {
            Some(fault) => fault.after_update(parameters, step),
            None => Ok(()),
        }
    }

    /// The clean end: every rank has finished, none is reported as lost.
    pub fn finish(self) -> Result<()> {
        drop(self.watchdog);
        self.control.finish()
    }

    /// Gathers `values` of every rank, rank by rank, on the host.
    fn all_gather_host(&mut self, values: &[f32], step: usize) -> Result<Vec<f32>> {
        let world = self.world.world_size;
        let _in_flight = self.watchdog.arm("all-gather", step);
        match &mut self.comm {
            Communicator::Host(comm) => {
                let mut out = vec![0.0; values.len() * world];
                comm.all_gather(values, &mut out).context("all-gathering across ranks")?;
                Ok(out)
            }
            #[cfg(feature = "nccl")]
            Communicator::Nccl { comm, device } => {
                let send = device.upload(values).map_err(|e| anyhow!("{e}"))?;
                let mut recv = device.zeros::<f32>(values.len() * world).map_err(|e| anyhow!("{e}"))?;
                comm.all_gather(&send, &mut recv).context("all-gathering across ranks")?;
                device.download(&recv).map_err(|e| anyhow!("{e}"))
            }
        }
    }
}

impl Communicator {
    /// Reduces `flat` (contiguous f32, on this rank's device) in place across ranks.
    fn all_reduce(&mut self, flat: &mut Tensor, op: ReduceOp) -> Result<()> {
        match self {
            Communicator::Host(comm) => Ok(comm.all_reduce(flat.as_mut_slice()?, op)?),
            #[cfg(feature = "nccl")]
            Communicator::Nccl { comm, .. } => {
                let (_, buffer) = flat.cuda_f32_mut("all-reduce")?;
                Ok(comm.all_reduce(buffer, op)?)
            }
        }
    }

    /// The watchdog's check for errors the communicator raises asynchronously (NCCL's).
    fn async_error_poll(&self) -> Option<Box<dyn Fn() -> Option<String> + Send + Sync>> {
        match self {
            Communicator::Host(_) => None,
            #[cfg(feature = "nccl")]
            Communicator::Nccl { comm, .. } => {
                let handle = comm.watchdog_handle();
                Some(Box::new(move || handle.async_error().err().map(|e| format!("NCCL reported: {e}"))))
            }
        }
    }
}

/// A new communicator id, made by rank 0 where the others can reach it: NCCL's for a GPU
/// run, the host collective's (a listener on `master`) for a CPU run.
fn new_unique_id(device: Device, master: IpAddr) -> Result<UniqueId> {
    match device {
        Device::Cpu => Ok(UniqueId::new(master).context("creating the host collective's id")?),
        #[cfg(feature = "nccl")]
        Device::Cuda(ordinal) => {
            let device = tensor::cuda::device(ordinal)?;
            Ok(kernels::cuda::nccl::unique_id(&device, master)?)
        }
        #[cfg(not(feature = "nccl"))]
        Device::Cuda(_) => bail!("{}", NO_NCCL),
    }
}

#[cfg(not(feature = "nccl"))]
const NO_NCCL: &str =
    "data parallel on a GPU needs NCCL: this build has no feature `nccl` (build with --features nccl)";

/// The NCCL communicator of rank `world.rank` on GPU `ordinal`.
#[cfg(feature = "nccl")]
fn nccl_communicator(ordinal: usize, id: &UniqueId, world: &World, timeout: Duration) -> Result<Communicator> {
    let device = tensor::cuda::device(ordinal)?;
    let comm = kernels::cuda::nccl::NcclComm::init(&device, id, world.rank, world.world_size, timeout)
        .context("joining the NCCL communicator")?;
    if world.is_leader() {
        crate::say!("data parallel: {} ranks on {}", world.world_size, comm.describe());
    }
    Ok(Communicator::Nccl { comm, device })
}

#[cfg(not(feature = "nccl"))]
fn nccl_communicator(_: usize, _: &UniqueId, _: &World, _: Duration) -> Result<Communicator> {
    bail!("{}", NO_NCCL)
}

/// `MASTER_ADDR` as an address this host can bind when it is rank 0 and the others reach.
fn master_ip(world: &World) -> Result<IpAddr> {
    let mut addresses = (world.master_addr.as_str(), world.master_port)
        .to_socket_addrs()
        .with_context(|| format!("resolving MASTER_ADDR {}", world.master_addr))?;
    addresses.next().map(|a| a.ip()).ok_or_else(|| anyhow!("MASTER_ADDR {} resolves to no address", world.master_addr))
}

/// What every rank must agree on: the training config (world size included) and the binary.
fn config_fingerprint(config: &TrainConfig) -> Result<u64> {
    let json = serde_json::to_string(config).context("serialising the training config")?;
    Ok(fnv1a_64(format!("{}\n{json}", env!("CARGO_PKG_VERSION")).as_bytes()))
}

/// FNV-1a over the name and the bits of every parameter, in order, one tensor at a time
/// (downloads GPU parameters).
fn parameter_hash(parameters: &[NamedParameter]) -> Result<u64> {
    let mut hash = FNV_OFFSET_BASIS;
    for p in parameters {
        hash = fnv1a_64_update(hash, p.name.as_bytes());
        let bytes: Vec<u8> = p.var.value().to_host()?.to_vec().iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
        hash = fnv1a_64_update(hash, &bytes);
    }
    Ok(hash)
}

/// A fault the multi-rank tests inject on one rank (`TRANSPONDER_TEST_FAULT=RANK:KIND@STEP`,
/// KIND `exit`, `hang` or `perturb`): nothing a run uses otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fault {
    kind: FaultKind,
    step: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultKind {
    /// The process dies before the step's all-reduce (as a crash or a kill would).
    Exit,
    /// The process stops answering before the step's all-reduce.
    Hang,
    /// One parameter changes after the step's update, on this rank only.
    Perturb,
}

impl Fault {
    fn from_env(rank: usize) -> Result<Option<Fault>> {
        let Ok(spec) = std::env::var("TRANSPONDER_TEST_FAULT") else {
            return Ok(None);
        };
        let parse = || -> Option<(usize, Fault)> {
            let (on_rank, rest) = spec.split_once(':')?;
            let (kind, step) = rest.split_once('@')?;
            let kind = match kind {
                "exit" => FaultKind::Exit,
                "hang" => FaultKind::Hang,
                "perturb" => FaultKind::Perturb,
                _ => return None,
            };
            Some((on_rank.parse().ok()?, Fault { kind, step: step.parse().ok()? }))
        };
        match parse() {
            Some((on_rank, fault)) => Ok((on_rank == rank).then_some(fault)),
            None => bail!("TRANSPONDER_TEST_FAULT={spec}: expected RANK:KIND@STEP with KIND exit, hang or perturb"),
        }
    }

    fn before_all_reduce(self, step: usize) {
        if step != self.step {
            return;
        }
        match self.kind {
            FaultKind::Exit => std::process::abort(),
            FaultKind::Hang => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            FaultKind::Perturb => {}
        }
    }

    fn after_update(self, parameters: &[NamedParameter], step: usize) -> Result<()> {
        if self.kind == FaultKind::Perturb && step == self.step {
            if let Some(first) = parameters.first() {
                let value = first.var.value();
                let bumped = value.add(&value.full_like(1e-3)?)?;
                *first.var.value_mut() = bumped;
            }
        }
        Ok(())
    }
}
