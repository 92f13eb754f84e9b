//! CUDA graphs (`kernels::cuda::graph`): a step captured once replays on its buffers'
//! current contents, bit for bit what the same step computes eagerly; its memory stays its
//! own; the device counts a replay as the work it queues; and a capture refuses what a
//! graph cannot hold (host copies, waits, driver allocations, another thread's work). On a
//! GPU or the emulated device; the last test is the emulator's own check of a replay.
#![cfg(feature = "cuda")]

use kernels::cpu::matmul::{GemmDims, Store};
use kernels::cpu::unary::Unary;
use kernels::cuda::blas::{matmul, DeviceMat};
use kernels::cuda::elementwise::{axpy, unary_forward};
use kernels::cuda::{CudaDevice, CudaError, DeviceBuffer, Result};

const SIDE: usize = 16;
const LEN: usize = SIDE * SIDE;

/// A device (a GPU, else the emulated one), or `None` (saying so) without either.
fn device() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            assert!(std::env::var_os("TRANSPONDER_REQUIRE_CUDA").is_none(), "TRANSPONDER_REQUIRE_CUDA is set: {e}");
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// Reproducible values in [-1, 1), a different sequence per `seed`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    (0..len as u64).map(|i| ((i * 37 + seed * 101) % 199) as f32 / 99.5 - 1.0).collect()
}

fn mat(buffer: &DeviceBuffer<f32>) -> DeviceMat<'_> {
    DeviceMat { buffer, offset: 0, row_stride: SIDE, col_stride: 1 }
}

/// The step under test: `y = exp(x)·w + x/2` through a scratch buffer, then `out = 0 + y`
/// through a zeroed scratch buffer and a device copy: a launch, a product, a memset and a
/// copy, with memory allocated and dropped inside the step.
fn step(
    dev: &CudaDevice,
    x: &DeviceBuffer<f32>,
    w: &DeviceBuffer<f32>,
    y: &mut DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let mut exp_x = dev.alloc::<f32>(LEN)?;
    unary_forward(dev, Unary::Exp, x, &mut exp_x)?;
    let dims = GemmDims { m: SIDE, n: SIDE, k: SIDE };
    matmul(dev, y, 0, mat(&exp_x), mat(w), dims, Store::Overwrite)?;
    axpy(dev, 0.5, x, y)?;
    let mut zeroed = dev.zeros::<f32>(LEN)?;
    axpy(dev, 1.0, y, &mut zeroed)?;
    dev.copy_within_device(&zeroed, 0, out, 0, LEN)
}

/// The step run eagerly on fresh buffers for input `x`: `(y, out)`.
fn eager(dev: &CudaDevice, x: &[f32], w: &DeviceBuffer<f32>) -> (Vec<f32>, Vec<f32>) {
    let x = dev.upload(x).unwrap();
    let (mut y, mut out) = (dev.alloc(LEN).unwrap(), dev.alloc(LEN).unwrap());
    step(dev, &x, w, &mut y, &mut out).unwrap();
    (dev.download(&y).unwrap(), dev.download(&out).unwrap())
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_replay_computes_the_captured_step_on_the_inputs_refilled_before_it() {
    let Some(dev) = device() else { return };
    let w = dev.upload(&values(LEN, 7)).unwrap();
    let mut x = dev.upload(&values(LEN, 1)).unwrap();
    let (mut y, mut out) = (dev.alloc(LEN).unwrap(), dev.alloc(LEN).unwrap());
    let pool = dev.graph_pool();
    dev.with_graph_pool(&pool, || step(&dev, &x, &w, &mut y, &mut out)).unwrap();
    let before = dev.counters();
    let (graph, ()) = dev.capture(pool, || step(&dev, &x, &w, &mut y, &mut out)).unwrap();
    let captured = dev.counters().since(&before);
    assert_eq!(captured.launches, 0, "a capture runs nothing and counts nothing: {captured:?}");
    assert_eq!(captured.driver_allocations, 0, "the run in the pool left every block the capture needs");
    assert_eq!(graph.work().launches, 4, "exp, the product and two axpys: {:?}", graph.work());
    assert_eq!((graph.work().memsets, graph.work().device_copies), (1, 1));

    // An eager buffer of the scratch buffers' size, made after the capture: the pool keeps
    // their blocks, so no replay writes over it.
    let kept = dev.upload(&[3.0f32; LEN]).unwrap();
    for seed in 2..5 {
        let input = values(LEN, seed);
        dev.copy_to_device(&input, &mut x).unwrap();
        let before = dev.counters();
        dev.replay(&graph).unwrap();
        let replayed = dev.counters().since(&before);
        assert_eq!(replayed.launches_by_kernel, graph.work().launches_by_kernel);
        assert_eq!((replayed.graph_launches, replayed.buffer_requests, replayed.syncs), (1, 0, 0));
        let (want_y, want_out) = eager(&dev, &input, &w);
        assert_eq!(bits(&dev.download(&y).unwrap()), bits(&want_y), "y after replay {seed}");
        assert_eq!(bits(&dev.download(&out).unwrap()), bits(&want_out), "out after replay {seed}");
    }
    assert_eq!(dev.download(&kept).unwrap(), vec![3.0; LEN], "a replay wrote over memory it gave up");
}

fn capture_error<T: std::fmt::Debug>(result: Result<T>) -> &'static str {
    match result {
        Err(CudaError::Capture { op, .. }) => op,
        other => panic!("expected a capture error, got {other:?}"),
    }
}

#[test]
fn a_capture_refuses_host_copies_waits_driver_allocations_and_other_threads() {
    let Some(dev) = device() else { return };
    let mut x = dev.upload(&values(LEN, 1)).unwrap();
    let mut y = dev.alloc::<f32>(LEN).unwrap();
    let small = dev.upload(&[1.0f32; 4]).unwrap();
    let pool = dev.graph_pool();
    let (graph, refused) = dev
        .capture(pool, || -> Result<Vec<&'static str>> {
            let refused = vec![
                capture_error(dev.synchronize()),
                capture_error(dev.copy_to_device(&[0.0; LEN], &mut x)),
                capture_error(dev.download(&x)),
                capture_error(dev.read_later(&small).map(drop)),
                capture_error(dev.alloc::<f32>(LEN)),
                std::thread::scope(|s| s.spawn(|| capture_error(axpy(&dev, 1.0, &x, &mut y))).join().unwrap()),
            ];
            Ok(refused)
        })
        .unwrap();
    assert_eq!(
        refused,
        ["synchronize", "copy_to_device", "copy_to_host", "read_later", "device allocation", "axpy"],
        "each refused call names itself"
    );
    assert_eq!(graph.work().launches, 0);
    // The device is its own again: the same calls work.
    axpy(&dev, 1.0, &x, &mut y).unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn a_capture_whose_step_fails_returns_the_steps_error_and_frees_the_device() {
    let Some(dev) = device() else { return };
    let pool = dev.graph_pool();
    let x = dev.upload(&values(LEN, 1)).unwrap();
    let mut short = dev.alloc::<f32>(LEN / 2).unwrap();
    let failed = dev.capture(pool, || axpy(&dev, 1.0, &x, &mut short));
    assert!(matches!(failed, Err(CudaError::Shape { op: "axpy", .. })), "{failed:?}");
    dev.synchronize().unwrap();
}

/// The emulator checks, before a replay, that the graph's addresses are still its own.
#[cfg(feature = "cuda-emu")]
#[test]
fn an_emulated_replay_refuses_a_graph_that_reads_a_buffer_dropped_since_the_capture() {
    let dev = CudaDevice::emulated().unwrap();
    let source = dev.upload(&values(LEN, 1)).unwrap();
    let mut sum = dev.zeros::<f32>(LEN).unwrap();
    let pool = dev.graph_pool();
    let (graph, ()) = dev.capture(pool, || axpy(&dev, 1.0, &source, &mut sum)).unwrap();
    dev.replay(&graph).unwrap();
    assert_eq!(dev.download(&sum).unwrap(), values(LEN, 1));
    drop(source);
    let message = match dev.replay(&graph) {
        Err(CudaError::Capture { op: "replay", message }) => message,
        other => panic!("expected the replay to be refused, got {other:?}"),
    };
    assert!(message.contains("axpy"), "the refusal names the kernel: {message}");
}
