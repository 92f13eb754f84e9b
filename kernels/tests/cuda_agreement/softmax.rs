//! Softmax and log-softmax forward and backward; cross-entropy with `ignore_index`; the fused
//! cross-entropy pass of the LM head's chunks (the gradient written over the logits).

use half::bf16;
use kernels::cpu;
use kernels::cuda::{self, CudaError, ValuesMut};

use super::{assert_close, assert_reduced, assert_twin, down, stale, up, Rng};

#[test]
fn softmax_and_log_softmax_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(5);
    // Widths a multiple of 4 take the kernels' 4-column chunks (4,100: four chunks a step, then
    // one); the others, element by element.
    for (rows, cols) in [(300, 257), (7, 1), (3, 5000), (64, 33), (5, 4100), (9, 64)] {
        let x = rng.vec(rows * cols, -20.0, 20.0);
        let dy = rng.vec(rows * cols, -1.0, 1.0);
        let start = stale(rows * cols);
        let (gx, gdy) = (up(dev, &x), up(dev, &dy));
        for log in [false, true] {
            let mut y = vec![0.0; x.len()];
            let mut dx = start.clone();
            let mut gy = dev.alloc(x.len()).unwrap();
            let mut gdx = up(dev, &start);
            if log {
                cpu::softmax::log_softmax_forward(&x, cols, &mut y);
                cpu::softmax::log_softmax_backward(&y, &dy, cols, &mut dx);
                cuda::softmax::log_softmax_forward(dev, &gx, cols, &mut gy).unwrap();
                cuda::softmax::log_softmax_backward(dev, &up(dev, &y), &gdy, cols, &mut gdx).unwrap();
            } else {
                cpu::softmax::softmax_forward(&x, cols, &mut y);
                cpu::softmax::softmax_backward(&y, &dy, cols, &mut dx);
                cuda::softmax::softmax_forward(dev, &gx, cols, &mut gy).unwrap();
                cuda::softmax::softmax_backward(dev, &up(dev, &y), &gdy, cols, &mut gdx).unwrap();
            }
            assert_close(&format!("softmax(log {log}) {rows}×{cols}"), &down(dev, &gy), &y, 1e-5, 1e-6);
            assert_reduced(&format!("softmax backward(log {log}) {rows}×{cols}"), &down(dev, &gdx), &dx);
        }
    }
}

#[test]
fn cross_entropy_agrees_with_ignore_index() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(6);
    for (rows, cols, ignore) in
        [(64, 5003, None), (300, 37, Some(3u32)), (5, 1, None), (16, 8192, Some(7)), (40, 96, None)]
    {
        let logits = rng.vec(rows * cols, -8.0, 8.0);
        let targets: Vec<u32> = (0..rows).map(|_| rng.below(cols as u32)).collect();
        let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        let dims = cpu::cross_entropy::CrossEntropyDims { rows, cols, ignore_index: ignore };
        let kept = cpu::cross_entropy::cross_entropy_forward(&logits, &targets, &dims, &mut losses, &mut lse);
        let (glogits, gtargets) = (up(dev, &logits), dev.upload(&targets).unwrap());
        let (mut glosses, mut glse) = (dev.alloc(rows).unwrap(), dev.alloc(rows).unwrap());
        let gkept =
            cuda::softmax::cross_entropy_forward(dev, &glogits, &gtargets, &dims, &mut glosses, &mut glse).unwrap();
        assert_eq!(gkept, kept);
        assert_close("cross-entropy losses", &down(dev, &glosses), &losses, 1e-5, 1e-6);
        assert_close("cross-entropy lse", &down(dev, &glse), &lse, 1e-5, 1e-6);
        let start = stale(rows * cols);
        let mut dlogits = start.clone();
        // The GPU reads the mean loss's gradient (0.75) on the device and divides by the count.
        let scale = 0.75 / kept as f32;
        cpu::cross_entropy::cross_entropy_backward(&logits, &targets, &dims, &lse, scale, &mut dlogits);
        let mut gd = up(dev, &start);
        let (upstream, count) = (up(dev, &[0.75]), kept);
        let g_scale = cuda::softmax::MeanLossGrad { upstream: &upstream, count };
        cuda::softmax::cross_entropy_backward(dev, &glogits, &gtargets, &dims, &glse, g_scale, (&mut gd, None))
            .unwrap();
        assert_close("cross-entropy backward", &down(dev, &gd), &dlogits, 1e-5, 1e-6);
        let (mut gd2, mut gd16) = (up(dev, &start), dev.alloc::<bf16>(rows * cols).unwrap());
        let g_scale = cuda::softmax::MeanLossGrad { upstream: &upstream, count };
        let twin = (&mut gd2, Some(&mut gd16));
        cuda::softmax::cross_entropy_backward(dev, &glogits, &gtargets, &dims, &glse, g_scale, twin).unwrap();
        assert_twin(dev, "cross-entropy backward", &gd2, &gd, &gd16);
    }
    // A target out of range is an error, not a panic.
    let (glogits, bad) = (up(dev, &[0.0, 1.0]), dev.upload(&[2u32]).unwrap());
    let (mut l, mut s) = (dev.alloc(1).unwrap(), dev.alloc(1).unwrap());
    let dims = cpu::cross_entropy::CrossEntropyDims { rows: 1, cols: 2, ignore_index: None };
    let result = cuda::softmax::cross_entropy_forward(dev, &glogits, &bad, &dims, &mut l, &mut s);
    assert!(matches!(result, Err(CudaError::Invalid { .. })), "{result:?}");
}

/// The fused pass on one chunk of rows, the chunk's first row at an offset of the targets and
/// losses: the CPU's losses and gradient, and the logits left as they were without a
/// gradient; from bf16 logits (a bf16 product's output), the CPU's pass over their f32 values
/// and the gradient rounded to bf16 over them.
#[test]
fn cross_entropy_forward_backward_agrees_on_a_chunk() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(7);
    for (rows, cols, first, ignore) in
        [(40, 3001, 7, Some(5u32)), (33, 37, 0, None), (6, 1, 2, None), (12, 4100, 3, Some(2)), (9, 256, 1, None)]
    {
        let total_rows = first + rows + 3;
        let logits = rng.vec(rows * cols, -8.0, 8.0);
        let mut targets: Vec<u32> = (0..total_rows).map(|_| rng.below(cols as u32)).collect();
        if let Some(ignore) = ignore {
            targets.iter_mut().step_by(4).for_each(|t| *t = ignore);
        }
        let dims = cpu::cross_entropy::CrossEntropyDims { rows, cols, ignore_index: ignore };
        let chunk_targets = &targets[first..][..rows];
        let cpu_pass = |logits: &[f32]| {
            let (mut dlogits, mut losses) = (logits.to_vec(), vec![0.0; rows]);
            cpu::cross_entropy::cross_entropy_forward_backward(
                &mut dlogits,
                chunk_targets,
                &dims,
                Some(0.25),
                &mut losses,
            );
            (dlogits, losses)
        };
        let what = format!("fused cross-entropy {rows}×{cols} from row {first}");
        // The chunk buffer is longer than the chunk (the last chunk of a run): its tail is left.
        let tail = [1.5f32; 5];
        let gtargets = dev.upload(&targets).unwrap();
        let run = |logits: &[f32], grad: bool, bf16_logits: bool| {
            let padded = [logits, &tail].concat();
            let halves: Vec<bf16> = padded.iter().map(|&v| bf16::from_f32(v)).collect();
            let (mut glogits, mut glogits16) = (up(dev, &padded), dev.upload(&halves).unwrap());
            let mut glosses = up(dev, &stale(total_rows));
            let values = if bf16_logits { ValuesMut::Bf16(&mut glogits16) } else { ValuesMut::F32(&mut glogits) };
            let grad = grad.then_some(0.25);
            cuda::softmax::cross_entropy_forward_backward(
                dev,
                values,
                (&gtargets).into(),
                first,
                &dims,
                grad,
                &mut glosses,
            )
            .unwrap();
            let glogits = if bf16_logits {
                dev.download(&glogits16).unwrap().into_iter().map(bf16::to_f32).collect()
            } else {
                down(dev, &glogits)
            };
            let glosses = down(dev, &glosses);
            assert_eq!(&glogits[rows * cols..], &tail, "{what}: wrote past the chunk");
            assert!(glosses[..first].iter().chain(&glosses[first + rows..]).all(|v| v.is_nan()), "{what}: other rows");
            (glogits[..rows * cols].to_vec(), glosses[first..][..rows].to_vec())
        };
        let (dlogits, losses) = cpu_pass(&logits);
        let (gradient, glosses) = run(&logits, true, false);
        assert_close(&format!("{what}: gradient"), &gradient, &dlogits, 1e-5, 1e-6);
        assert_close(&format!("{what}: losses"), &glosses, &losses, 1e-5, 1e-6);
        assert_eq!(run(&logits, false, false).0, logits, "{what}: without a gradient the logits stay");
        // bf16 logits: the pass over their values, the gradient rounded to nearest even (within
        // one bf16 step of the CPU's f32 gradient rounded: the device's expf may differ by an ulp).
        let rounded: Vec<f32> = logits.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let (dlogits, losses) = cpu_pass(&rounded);
        let (gradient, glosses) = run(&logits, true, true);
        assert_close(&format!("{what}: losses from bf16 logits"), &glosses, &losses, 1e-5, 1e-6);
        let want: Vec<f32> = dlogits.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_close(&format!("{what}: gradient over bf16 logits"), &gradient, &want, 1.0 / 128.0, 1e-6);
        assert_eq!(run(&logits, false, true).0, rounded, "{what}: without a gradient the bf16 logits stay");
    }
}
