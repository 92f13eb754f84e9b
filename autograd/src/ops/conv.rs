//! 2-D convolution (groups 1, dilation 1) as a graph op: `y = conv(x, w) (+ bias)`.
//!
//! PyTorch equivalent: `F.conv2d(x, w, bias, stride, padding)`. Saves `x` and `w` (the
//! backward rebuilds the im2col columns from `x`) and nothing else. The backward computes
//! only the gradients some input needs: the first convolution of a network, reading the
//! images, skips `dx` entirely. Gradients accumulate in the walk (`+=` semantics).

use kernels::cpu::conv::conv2d_backward;
use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `y[N, O, OH, OW] = conv(self[N, C, H, W], weight[O, C, KH, KW]) (+ bias[O])`, the same
    /// stride and zero padding along both axes.
    pub fn conv2d(&self, weight: &Var, bias: Option<&Var>, stride: usize, padding: usize) -> Result<Var> {
        let (x, w) = (self.value().contiguous()?, weight.value().contiguous()?);
        let b = bias.map(Var::value);
        let geometry = x.conv2d_geometry(&w, stride, padding)?;
        let y = x.conv2d(&w, b.as_ref(), stride, padding)?;
        let needs = [self.requires_grad(), weight.requires_grad(), bias.is_some_and(Var::requires_grad)];
        let mut inputs = vec![self.clone(), weight.clone()];
        inputs.extend(bias.cloned());
        let has_bias = bias.is_some();
        Ok(Var::from_op(y, inputs, move |dy| {
            let dy = dy.contiguous()?;
            let mut dx = needs[0].then(|| tensor::pool::zeros(x.numel()));
            let mut dw = needs[1].then(|| tensor::pool::zeros(w.numel()));
            let mut db = needs[2].then(|| tensor::pool::zeros(geometry.out_channels));
            // d/dx = col2im(wᵀ·dy),  d/dw = Σ_n dy_n·col_nᵀ,  d/dbias = Σ_{n,p} dy
            conv2d_backward(
                &geometry,
                x.as_slice()?,
                w.as_slice()?,
                dy.as_slice()?,
                dx.as_deref_mut(),
                dw.as_deref_mut(),
                db.as_deref_mut(),
            );
            // An input that needs no gradient gets an empty placeholder the walk never reads.
            let grad = |g: Option<Vec<f32>>, shape: &[usize]| match g {
                Some(g) => Tensor::from_vec(g, shape),
                None => Ok(Tensor::zeros(&[0])),
            };
            let mut grads = vec![grad(dx, x.shape())?, grad(dw, w.shape())?];
            if has_bias {
                grads.push(grad(db, &[geometry.out_channels])?);
            }
            Ok(grads)
        }))
    }
}
