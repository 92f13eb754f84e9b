//! Sum and max along an axis (first maximum, NaN wins) and the sum of squares.

use kernels::cpu;
use kernels::cuda;

use super::{assert_reduced, down, up, Rng};

#[test]
fn reductions_agree() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(4);
    for (outer, n, inner) in [(1, 100_000, 1), (37, 513, 1), (3, 5000, 40), (2000, 3, 17), (5, 1, 7)] {
        // Rounded values repeat, so "first maximum" is exercised.
        let x: Vec<f32> = rng.vec(outer * n * inner, -5.0, 5.0).iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let gx = up(dev, &x);
        let mut want = vec![0.0; outer * inner];
        cpu::reduce::sum_axis(&x, outer, n, inner, &mut want);
        let mut out = dev.alloc(outer * inner).unwrap();
        cuda::reduce::sum_axis(dev, &gx, outer, n, inner, &mut out).unwrap();
        assert_reduced(&format!("sum_axis {outer}×{n}×{inner}"), &down(dev, &out), &want);
        let mut argmax = vec![0usize; outer * inner];
        cpu::reduce::max_axis(&x, outer, n, inner, &mut want, &mut argmax);
        let mut garg = dev.alloc::<u32>(outer * inner).unwrap();
        cuda::reduce::max_axis(dev, &gx, outer, n, inner, &mut out, &mut garg).unwrap();
        assert_eq!(down(dev, &out), want, "max_axis values");
        let got: Vec<usize> = dev.download(&garg).unwrap().into_iter().map(|i| i as usize).collect();
        assert_eq!(got, argmax, "max_axis indices {outer}×{n}×{inner}");
        let squares = cuda::reduce::sum_squares(dev, &gx).unwrap();
        let want_squares = cpu::reduce::sum_squares(&x);
        assert!((squares - want_squares).abs() <= 1e-9 * want_squares.max(1.0), "{squares} vs {want_squares}");
    }
    // NaN is the maximum, the first one wins.
    let x = [1.0, f32::NAN, 3.0, f32::NAN];
    let (mut out, mut arg) = (dev.alloc(1).unwrap(), dev.alloc::<u32>(1).unwrap());
    cuda::reduce::max_axis(dev, &up(dev, &x), 1, 4, 1, &mut out, &mut arg).unwrap();
    assert!(down(dev, &out)[0].is_nan());
    assert_eq!(dev.download(&arg).unwrap(), vec![1]);
}

/// The sum of squares of more tensors than one launch takes (two launches: 512 + 8) is the
/// host's f64 sum over all of them.
#[test]
fn sum_squares_of_many_tensors_agrees() {
    let dev = device_or_skip!();
    let mut rng = Rng::new(41);
    let xs: Vec<Vec<f32>> = (0..520).map(|i| rng.vec(1 + 97 * (i % 70), -2.0, 2.0)).collect();
    let uploaded: Vec<_> = xs.iter().map(|x| up(dev, x)).collect();
    let got = cuda::reduce::sum_squares_all(dev, &uploaded.iter().map(Into::into).collect::<Vec<_>>()).unwrap();
    let want: f64 = xs.iter().map(|x| cpu::reduce::sum_squares(x)).sum();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
}
