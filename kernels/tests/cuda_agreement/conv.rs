//! Convolution (forward and backward) and the poolings (max and global average).

use kernels::cpu;
use kernels::cpu::conv::Conv2dGeometry;
use kernels::cuda::{self, CudaError};

use super::{assert_elementwise, assert_reduced, down, stale, up, Rng};

#[test]
fn conv2d_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(11);
    let geometry = |batch, in_channels, out_channels, height, width, kernel: usize, stride, padding| Conv2dGeometry {
        batch,
        in_channels,
        out_channels,
        height,
        width,
        kernel_h: kernel,
        kernel_w: kernel,
        stride,
        padding,
    };
    for g in [
        geometry(4, 3, 8, 9, 9, 3, 1, 1),
        geometry(2, 5, 6, 11, 7, 3, 2, 1),
        geometry(3, 16, 32, 8, 8, 1, 1, 0),
        geometry(2, 4, 4, 6, 6, 1, 2, 0),
        geometry(1, 2, 3, 5, 5, 7, 1, 3),
    ] {
        let x = rng.vec(g.batch * g.in_channels * g.height * g.width, -1.0, 1.0);
        let w = rng.vec(g.out_channels * g.in_channels * g.kernel_h * g.kernel_w, -1.0, 1.0);
        let bias = rng.vec(g.out_channels, -1.0, 1.0);
        let y_len = g.batch * g.out_channels * g.out_height() * g.out_width();
        let (gx, gw, gbias) = (up(dev, &x), up(dev, &w), up(dev, &bias));
        for with_bias in [true, false] {
            let b = with_bias.then_some(&bias[..]);
            let mut y = vec![0.0; y_len];
            cpu::conv::conv2d_forward(&g, &x, &w, b, &mut y);
            let mut gy = dev.alloc(y_len).unwrap();
            cuda::conv::conv2d_forward(dev, &g, &gx, &gw, with_bias.then_some(&gbias), &mut gy).unwrap();
            assert_reduced(&format!("conv forward {g:?}"), &down(dev, &gy), &y);
        }
        let dy = rng.vec(y_len, -1.0, 1.0);
        let (sx, sw, sb) = (stale(x.len()), stale(w.len()), stale(bias.len()));
        let (mut dx, mut dw, mut db) = (sx.clone(), sw.clone(), sb.clone());
        cpu::conv::conv2d_backward(&g, &x, &w, &dy, Some(&mut dx), Some(&mut dw), Some(&mut db));
        let (mut gdx, mut gdw, mut gdb) = (up(dev, &sx), up(dev, &sw), up(dev, &sb));
        cuda::conv::conv2d_backward(dev, &g, &gx, &gw, &up(dev, &dy), Some(&mut gdx), Some(&mut gdw), Some(&mut gdb))
            .unwrap();
        assert_reduced(&format!("conv dx {g:?}"), &down(dev, &gdx), &dx);
        assert_reduced(&format!("conv dw {g:?}"), &down(dev, &gdw), &dw);
        assert_reduced(&format!("conv dbias {g:?}"), &down(dev, &gdb), &db);
    }
}

#[test]
fn max_pool_and_global_avg_pool_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(19);
    // (N·C, H, W, kernel, stride, padding): the ResNet stem's 3×3/2 padded, overlapping and
    // disjoint windows, a window as large as the padded input.
    for (planes, height, width, kernel, stride, padding) in
        [(6, 13, 11, 3, 2, 1), (4, 8, 8, 2, 2, 0), (3, 9, 7, 3, 1, 1), (2, 5, 6, 7, 1, 3), (5, 1, 9, 1, 3, 0)]
    {
        let g = cuda::pool::MaxPool2d { planes, height, width, kernel, stride, padding };
        let (out_h, out_w) = g.output_size();
        // Values on a coarse grid, so that windows hold ties (the first maximum wins).
        let x: Vec<f32> = (0..planes * height * width).map(|_| rng.below(7) as f32 - 3.0).collect();
        let (mut y, mut argmax) = (vec![0.0; planes * out_h * out_w], vec![0usize; planes * out_h * out_w]);
        cpu::pool::max_pool2d_forward(&g, &x, &mut y, &mut argmax);
        let (gx, mut gy, mut gargmax) = (up(dev, &x), dev.alloc(y.len()).unwrap(), dev.alloc::<u32>(y.len()).unwrap());
        cuda::pool::max_pool2d_forward(dev, &g, &gx, &mut gy, &mut gargmax).unwrap();
        let what = format!("max_pool2d {g:?}");
        assert_eq!(down(dev, &gy), y, "{what}: y");
        let argmax_gpu: Vec<usize> = dev.download(&gargmax).unwrap().into_iter().map(|a| a as usize).collect();
        assert_eq!(argmax_gpu, argmax, "{what}: argmax");
        let (dy, dx0) = (rng.vec(y.len(), -1.0, 1.0), stale(x.len()));
        let mut dx = dx0.clone();
        cpu::pool::max_pool2d_backward(&g, &argmax, &dy, &mut dx);
        let mut gdx = up(dev, &dx0);
        cuda::pool::max_pool2d_backward(dev, &g, &gargmax, &up(dev, &dy), &mut gdx).unwrap();
        assert_elementwise(&format!("{what}: dx"), &down(dev, &gdx), &dx);
    }
    for (planes, spatial) in [(12, 49), (3, 1), (2, 3001)] {
        let x = rng.vec(planes * spatial, -2.0, 2.0);
        let mut y = vec![0.0; planes];
        cpu::pool::global_avg_pool_forward(&x, planes, 1, spatial, &mut y);
        let mut gy = dev.alloc(planes).unwrap();
        cuda::pool::global_avg_pool_forward(dev, &up(dev, &x), planes, spatial, &mut gy).unwrap();
        assert_elementwise("global_avg_pool", &down(dev, &gy), &y);
        let (dy, dx0) = (rng.vec(planes, -1.0, 1.0), stale(x.len()));
        let mut dx = dx0.clone();
        cpu::pool::global_avg_pool_backward(&dy, planes, 1, spatial, &mut dx);
        let mut gdx = up(dev, &dx0);
        cuda::pool::global_avg_pool_backward(dev, &up(dev, &dy), planes, spatial, &mut gdx).unwrap();
        assert_elementwise("global_avg_pool dx", &down(dev, &gdx), &dx);
    }
    let bad = cuda::pool::MaxPool2d { planes: 1, height: 4, width: 4, kernel: 2, stride: 2, padding: 2 };
    let (gx, mut gy, mut ga) = (up(dev, &[0.0; 16]), dev.alloc(9).unwrap(), dev.alloc::<u32>(9).unwrap());
    assert!(matches!(cuda::pool::max_pool2d_forward(dev, &bad, &gx, &mut gy, &mut ga), Err(CudaError::Shape { .. })));
}
