//! RMSNorm, LayerNorm and batch norm (training and evaluation), forward and backward.

use half::bf16;
use kernels::cpu;
use kernels::cpu::batch_norm::{Affine, BatchNormDims, BatchStats, RunningStats};
use kernels::cpu::norm::{NormGrads, RowStats};
use kernels::cuda::{self, CudaError, Values, ValuesMut};

use super::{assert_close_to, assert_reduced, down, stale, up, Rng};

#[test]
fn rms_norm_and_layer_norm_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(7);
    // (66000, 5): chunks of 65 rows (more than 64·1024 rows), lanes of 8 or 9 rows.
    for (rows, cols) in [(2048, 67), (3, 768), (1, 1), (5000, 32), (66_000, 5), (9, 1100), (3, 1027)] {
        let (x, w, b, dy) = (
            rng.vec(rows * cols, -2.0, 2.0),
            rng.vec(cols, 0.5, 1.5),
            rng.vec(cols, -1.0, 1.0),
            rng.vec(rows * cols, -1.0, 1.0),
        );
        let (gx, gw, gb, gdy) = (up(dev, &x), up(dev, &w), up(dev, &b), up(dev, &dy));
        // Stale gradient buffers (NaN): both devices must overwrite them.
        let start = stale(rows * cols);
        let wstart = stale(cols);
        let dims = cpu::norm::NormDims { rows, cols, eps: 1e-5 };
        // RMSNorm
        let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
        cpu::norm::rms_norm_forward(&x, &w, &dims, &mut y, &mut rstd);
        let (mut gy, mut grstd) = (dev.alloc(x.len()).unwrap(), dev.alloc(rows).unwrap());
        cuda::norm::rms_norm_forward(dev, &gx, &gw, &dims, (ValuesMut::F32(&mut gy), None), &mut grstd).unwrap();
        assert_reduced("rms y", &down(dev, &gy), &y);
        assert_reduced("rms rstd", &down(dev, &grstd), &rstd);
        // With a bf16 twin: the same y, and the twin is y rounded to nearest even.
        let (mut gy2, mut gy16) = (dev.alloc(x.len()).unwrap(), dev.alloc::<bf16>(x.len()).unwrap());
        cuda::norm::rms_norm_forward(dev, &gx, &gw, &dims, (ValuesMut::F32(&mut gy2), Some(&mut gy16)), &mut grstd)
            .unwrap();
        let y2 = down(dev, &gy2);
        assert_eq!(y2, down(dev, &gy), "rms y with a twin");
        let rounded: Vec<bf16> = y2.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dev.download(&gy16).unwrap(), rounded, "rms y's bf16 twin is y rounded");
        // y in bf16 alone: the twin's bits, and no twin beside it.
        let mut gy_only = dev.alloc::<bf16>(x.len()).unwrap();
        cuda::norm::rms_norm_forward(dev, &gx, &gw, &dims, (ValuesMut::Bf16(&mut gy_only), None), &mut grstd).unwrap();
        assert_eq!(dev.download(&gy_only).unwrap(), rounded, "rms y in bf16 alone is y rounded");
        let twin = Some(&mut gy16);
        let result =
            cuda::norm::rms_norm_forward(dev, &gx, &gw, &dims, (ValuesMut::Bf16(&mut gy_only), twin), &mut grstd);
        assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
        let (mut dx, mut dw) = (start.clone(), wstart.clone());
        let grads = NormGrads { dx: &mut dx[..], dweight: Some(&mut dw[..]), dbias: None };
        cpu::norm::rms_norm_backward(&x, &w, &rstd, (&dy, None), &dims, grads);
        let (mut gdx, mut gdw) = (up(dev, &start), up(dev, &wstart));
        let grads = NormGrads { dx: &mut gdx, dweight: Some(&mut gdw), dbias: None };
        cuda::norm::rms_norm_backward(dev, &gx, &gw, &up(dev, &rstd), (Values::F32(&gdy), None), &dims, (grads, None))
            .unwrap();
        // dx = r·g − x·c cancels (over one column it is 0 up to eps and rounding): its
        // rounding is relative to the terms r·g, not to dx.
        let terms = (0..x.len()).fold(0.0f32, |m, i| m.max((dy[i] * w[i % cols] * rstd[i / cols]).abs()));
        assert_close_to("rms dx", &down(dev, &gdx), &dx, 1e-4, 1e-4 * terms);
        assert_reduced("rms dw", &down(dev, &gdw), &dw);
        // dy in bf16 (the input gradient of the products reading y, under bf16 products): the
        // same bits as the f32 kernel on the same values widened.
        {
            let dy16: Vec<bf16> = dy.iter().map(|&v| bf16::from_f32(v)).collect();
            let widened: Vec<f32> = dy16.iter().map(|v| v.to_f32()).collect();
            let (gdy16, gdy_widened, grstd) = (dev.upload(&dy16).unwrap(), up(dev, &widened), up(dev, &rstd));
            let run = |dy: Values| {
                let (mut gdx, mut gdw) = (up(dev, &start), up(dev, &wstart));
                let grads = NormGrads { dx: &mut gdx, dweight: Some(&mut gdw), dbias: None };
                cuda::norm::rms_norm_backward(dev, &gx, &gw, &grstd, (dy, None), &dims, (grads, None)).unwrap();
                (down(dev, &gdx), down(dev, &gdw))
            };
            assert_eq!(run(Values::Bf16(&gdy16)), run(Values::F32(&gdy_widened)), "rms backward from a bf16 dy");
        }
        // RMSNorm's backward kernel writes dw's partial sums in its own pass; they are those of
        // the separate pass over x and dy (LayerNorm's, here with mean 0 and RMSNorm's rstd),
        // in the same order: the same bits.
        {
            let (zeros, grstd) = (up(dev, &vec![0.0; rows]), up(dev, &rstd));
            let (mut gdx_ln, mut gdw_ln) = (up(dev, &start), up(dev, &wstart));
            let stats = RowStats { mean: &zeros, rstd: &grstd };
            let grads = NormGrads { dx: &mut gdx_ln, dweight: Some(&mut gdw_ln), dbias: None };
            cuda::norm::layer_norm_backward(dev, &gx, Some(&gw), stats, &gdy, &dims, grads).unwrap();
            assert_eq!(down(dev, &gdw), down(dev, &gdw_ln), "rms dw in the backward's pass equals the separate sum");
        }
        // With the residual stream's gradient added in the same pass, and dx's bf16 twin: the
        // residual plus the dx above, bit for bit on each device, and the twin is dx rounded.
        let residual = rng.vec(rows * cols, -1.0, 1.0);
        let mut total = start.clone();
        let grads = NormGrads { dx: &mut total[..], dweight: None, dbias: None };
        cpu::norm::rms_norm_backward(&x, &w, &rstd, (&dy, Some(&residual)), &dims, grads);
        let want: Vec<f32> = residual.iter().zip(&dx).map(|(r, d)| r + d).collect();
        assert_eq!(total, want, "cpu dx with the residual gradient");
        let (mut gtotal, mut gtotal16) = (up(dev, &start), dev.alloc::<bf16>(x.len()).unwrap());
        let grads = NormGrads { dx: &mut gtotal, dweight: None, dbias: None };
        let inputs = (Values::F32(&gdy), Some(&up(dev, &residual)));
        cuda::norm::rms_norm_backward(dev, &gx, &gw, &up(dev, &rstd), inputs, &dims, (grads, Some(&mut gtotal16)))
            .unwrap();
        let gtotal = down(dev, &gtotal);
        let gwant: Vec<f32> = residual.iter().zip(&down(dev, &gdx)).map(|(r, d)| r + d).collect();
        assert_eq!(gtotal, gwant, "device dx with the residual gradient");
        let rounded: Vec<bf16> = gtotal.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dev.download(&gtotal16).unwrap(), rounded, "rms dx's bf16 twin is dx rounded");
        // LayerNorm, with and without the affine parameters. Not over one column: there x̂ is
        // 0 up to the rounding of the mean, which rstd = 1/√eps amplifies twice, so dx (= the
        // starting gradient in exact arithmetic) differs between any two summation orders by
        // more than the tolerance (an H100 gave 3.9e-6 on a value of 0.0115).
        for affine in [true, false].into_iter().filter(|_| cols > 1) {
            let (wo, bo) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            let (gwo, gbo) = if affine { (Some(&gw), Some(&gb)) } else { (None, None) };
            let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
            cpu::norm::layer_norm_forward(
                &x,
                wo,
                bo,
                &dims,
                &mut y,
                RowStats { mean: &mut mean[..], rstd: &mut rstd[..] },
            );
            let (mut gy, mut gmean, mut grstd) =
                (dev.alloc(x.len()).unwrap(), dev.alloc(rows).unwrap(), dev.alloc(rows).unwrap());
            let stats = RowStats { mean: &mut gmean, rstd: &mut grstd };
            cuda::norm::layer_norm_forward(dev, &gx, gwo, gbo, &dims, &mut gy, stats).unwrap();
            assert_reduced("layer y", &down(dev, &gy), &y);
            assert_reduced("layer mean", &down(dev, &gmean), &mean);
            assert_reduced("layer rstd", &down(dev, &grstd), &rstd);
            let (mut dx, mut dw, mut db) = (start.clone(), wstart.clone(), wstart.clone());
            let (dwo, dbo) = if affine { (Some(&mut dw[..]), Some(&mut db[..])) } else { (None, None) };
            let (stats, grads) = (
                RowStats { mean: &mean[..], rstd: &rstd[..] },
                NormGrads { dx: &mut dx[..], dweight: dwo, dbias: dbo },
            );
            cpu::norm::layer_norm_backward(&x, wo, stats, &dy, &dims, grads);
            let (mut gdx, mut gdw, mut gdb) = (up(dev, &start), up(dev, &wstart), up(dev, &wstart));
            let (gdwo, gdbo) = if affine { (Some(&mut gdw), Some(&mut gdb)) } else { (None, None) };
            let (gm, gr) = (up(dev, &mean), up(dev, &rstd));
            let (stats, grads) =
                (RowStats { mean: &gm, rstd: &gr }, NormGrads { dx: &mut gdx, dweight: gdwo, dbias: gdbo });
            cuda::norm::layer_norm_backward(dev, &gx, gwo, stats, &gdy, &dims, grads).unwrap();
            assert_reduced("layer dx", &down(dev, &gdx), &dx);
            assert_reduced("layer dw", &down(dev, &gdw), &dw);
            assert_reduced("layer db", &down(dev, &gdb), &db);
        }
    }
    // Shape errors come back before any launch.
    let (gx, gw) = (up(dev, &[1.0; 10]), up(dev, &[1.0; 3]));
    let (mut gy, mut gr) = (dev.alloc(10).unwrap(), dev.alloc(2).unwrap());
    let result = cuda::norm::rms_norm_forward(
        dev,
        &gx,
        &gw,
        &cpu::norm::NormDims::of(10, 5, 1e-5),
        (ValuesMut::F32(&mut gy), None),
        &mut gr,
    );
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

#[test]
fn add_rms_norm_agrees_and_equals_add_then_rms_norm() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(8);
    for (rows, cols) in [(2048, 67), (3, 768), (1, 1), (16, 512), (9, 1100), (3, 1027)] {
        let (x, delta, w) = (rng.vec(rows * cols, -2.0, 2.0), rng.vec(rows * cols, -2.0, 2.0), rng.vec(cols, 0.5, 1.5));
        let (gx, gdelta, gw) = (up(dev, &x), up(dev, &delta), up(dev, &w));
        let dims = cpu::norm::NormDims { rows, cols, eps: 1e-5 };
        let (mut sum, mut y, mut rstd) = (stale(x.len()), stale(x.len()), stale(rows));
        cpu::norm::add_rms_norm_forward(&x, &delta, &w, &dims, (&mut sum, &mut y), &mut rstd);
        let (mut gsum, mut gy, mut grstd) = (up(dev, &stale(x.len())), up(dev, &stale(x.len())), up(dev, &stale(rows)));
        let mut gy16 = dev.alloc::<bf16>(x.len()).unwrap();
        let outputs = (&mut gsum, ValuesMut::F32(&mut gy), Some(&mut gy16));
        cuda::norm::add_rms_norm_forward(dev, (&gx, Values::F32(&gdelta)), &gw, &dims, outputs, &mut grstd).unwrap();
        assert_eq!(down(dev, &gsum), sum, "sum is x + delta on both devices");
        assert_reduced("add_rms y", &down(dev, &gy), &y);
        assert_reduced("add_rms rstd", &down(dev, &grstd), &rstd);
        let rounded: Vec<bf16> = down(dev, &gy).iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dev.download(&gy16).unwrap(), rounded, "add_rms y's bf16 twin is y rounded");
        let (mut gsum_only, mut gy_only) = (up(dev, &stale(x.len())), dev.alloc::<bf16>(x.len()).unwrap());
        let outputs = (&mut gsum_only, ValuesMut::Bf16(&mut gy_only), None);
        cuda::norm::add_rms_norm_forward(dev, (&gx, Values::F32(&gdelta)), &gw, &dims, outputs, &mut grstd).unwrap();
        assert_eq!(down(dev, &gsum_only), sum, "sum beside a bf16 y");
        assert_eq!(dev.download(&gy_only).unwrap(), rounded, "add_rms y in bf16 alone is y rounded");
        // The same arithmetic as rms_norm_forward of the sum, on the device too: bit for bit.
        let (mut gy2, mut grstd2) = (dev.alloc(x.len()).unwrap(), dev.alloc(rows).unwrap());
        cuda::norm::rms_norm_forward(dev, &gsum, &gw, &dims, (ValuesMut::F32(&mut gy2), None), &mut grstd2).unwrap();
        assert_eq!(down(dev, &gy2), down(dev, &gy), "add_rms y equals rms_norm of the sum");
        assert_eq!(down(dev, &grstd2), down(dev, &grstd), "add_rms rstd equals rms_norm's");
        // delta in bf16 (an output projection's product stored so): the f32 kernel's bits on
        // the widened values.
        let delta16: Vec<bf16> = delta.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = delta16.iter().map(|v| v.to_f32()).collect();
        let (gdelta16, gwidened) = (dev.upload(&delta16).unwrap(), up(dev, &widened));
        let mut run = |delta: Values| {
            let (mut gsum, mut gy) = (up(dev, &stale(x.len())), up(dev, &stale(x.len())));
            let outputs = (&mut gsum, ValuesMut::F32(&mut gy), None);
            cuda::norm::add_rms_norm_forward(dev, (&gx, delta), &gw, &dims, outputs, &mut grstd).unwrap();
            (down(dev, &gsum), down(dev, &gy), down(dev, &grstd))
        };
        assert_eq!(run(Values::Bf16(&gdelta16)), run(Values::F32(&gwidened)), "add_rms from a bf16 delta");
    }
    // Shape errors come back before any launch.
    let (gx, gd, gw) = (up(dev, &[1.0; 10]), up(dev, &[1.0; 5]), up(dev, &[1.0; 5]));
    let (mut gs, mut gy, mut gr) = (dev.alloc(10).unwrap(), dev.alloc(10).unwrap(), dev.alloc(2).unwrap());
    let dims = cpu::norm::NormDims::of(10, 5, 1e-5);
    let result = cuda::norm::add_rms_norm_forward(
        dev,
        (&gx, Values::F32(&gd)),
        &gw,
        &dims,
        (&mut gs, ValuesMut::F32(&mut gy), None),
        &mut gr,
    );
    assert!(matches!(result, Err(CudaError::Shape { .. })), "{result:?}");
}

#[test]
fn batch_norm_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(12);
    for (batch, channels, spatial) in [(8, 16, 64), (3, 4, 3001), (2, 3, 1)] {
        let x = rng.vec(batch * channels * spatial, -3.0, 3.0);
        let (w, b) = (rng.vec(channels, 0.5, 1.5), rng.vec(channels, -1.0, 1.0));
        let (rm0, rv0) = (rng.vec(channels, -0.5, 0.5), rng.vec(channels, 0.5, 2.0));
        let (gx, gw, gb) = (up(dev, &x), up(dev, &w), up(dev, &b));
        for affine in [true, false] {
            let (wo, bo) = if affine { (Some(&w[..]), Some(&b[..])) } else { (None, None) };
            let (gwo, gbo) = if affine { (Some(&gw), Some(&gb)) } else { (None, None) };
            let (mut rm, mut rv) = (rm0.clone(), rv0.clone());
            let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; channels], vec![0.0; channels]);
            let dims = BatchNormDims { batch, channels, spatial, eps: 1e-5, momentum: 0.1 };
            let running = RunningStats { mean: &mut rm[..], var: &mut rv[..] };
            let stats = BatchStats { mean: &mut mean[..], rstd: &mut rstd[..] };
            cpu::batch_norm::batch_norm_train_forward(
                &x,
                Affine { weight: wo, bias: bo },
                &dims,
                running,
                &mut y,
                stats,
            );
            let (mut grm, mut grv) = (up(dev, &rm0), up(dev, &rv0));
            let (mut gy, mut gmean, mut grstd) =
                (dev.alloc(x.len()).unwrap(), dev.alloc(channels).unwrap(), dev.alloc(channels).unwrap());
            let running = RunningStats { mean: &mut grm, var: &mut grv };
            let stats = BatchStats { mean: &mut gmean, rstd: &mut grstd };
            let affine = Affine { weight: gwo, bias: gbo };
            cuda::batch_norm::batch_norm_train_forward(dev, &gx, affine, &dims, running, &mut gy, stats).unwrap();
            assert_reduced("bn y", &down(dev, &gy), &y);
            assert_reduced("bn mean", &down(dev, &gmean), &mean);
            assert_reduced("bn rstd", &down(dev, &grstd), &rstd);
            assert_reduced("bn running mean", &down(dev, &grm), &rm);
            assert_reduced("bn running var", &down(dev, &grv), &rv);

            let mut y_eval = vec![0.0; x.len()];
            let running = RunningStats { mean: &rm[..], var: &rv[..] };
            cpu::batch_norm::batch_norm_eval_forward(&x, Affine { weight: wo, bias: bo }, &dims, running, &mut y_eval);
            let (affine, running) = (Affine { weight: gwo, bias: gbo }, RunningStats { mean: &grm, var: &grv });
            cuda::batch_norm::batch_norm_eval_forward(dev, &gx, affine, &dims, running, &mut gy).unwrap();
            assert_reduced("bn eval y", &down(dev, &gy), &y_eval);

            let dy = rng.vec(x.len(), -1.0, 1.0);
            let (sx, sc) = (stale(x.len()), stale(channels));
            let (mut dx, mut dw, mut db) = (sx.clone(), sc.clone(), sc.clone());
            let stats = BatchStats { mean: &mean[..], rstd: &rstd[..] };
            let grads = NormGrads { dx: &mut dx[..], dweight: Some(&mut dw[..]), dbias: Some(&mut db[..]) };
            cpu::batch_norm::batch_norm_train_backward(&x, wo, stats, &dy, &dims, grads);
            let (mut gdx, mut gdw, mut gdb) = (up(dev, &sx), up(dev, &sc), up(dev, &sc));
            let (gm, gr) = (up(dev, &mean), up(dev, &rstd));
            let stats = BatchStats { mean: &gm, rstd: &gr };
            let grads = NormGrads { dx: &mut gdx, dweight: Some(&mut gdw), dbias: Some(&mut gdb) };
            cuda::batch_norm::batch_norm_train_backward(dev, &gx, gwo, stats, &up(dev, &dy), &dims, grads).unwrap();
            // dx = k·dy + slope·x + offset (k = rstd·w) nearly cancels where a channel holds
            // few values (two values normalise to ±1 whatever x is, so dx is 0 up to eps): its
            // rounding is relative to the terms, and the GPU fuses them into FMAs. An H100 gave
            // an error of 1.2e-7 on a dx of 2.8e-5 with terms near 0.9.
            let gain = |c: usize| rstd[c] * wo.map_or(1.0, |w| w[c]);
            let terms = (0..channels).map(gain).fold(0.0f32, f32::max) * dy.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_close_to("bn dx", &down(dev, &gdx), &dx, 1e-4, 2e-6 * terms);
            assert_reduced("bn dw", &down(dev, &gdw), &dw);
            assert_reduced("bn db", &down(dev, &gdb), &db);
        }
    }
}
