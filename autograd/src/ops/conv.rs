//! 2-D convolution (groups 1, dilation 1) as a graph op: `y = conv(x, w) (+ bias)`.
//!
//! PyTorch equivalent: `F.conv2d(x, w, bias, stride, padding)`. Saves `x` and `w` (the
//! backward rebuilds the im2col columns from `x`) and nothing else. The backward computes
//! only the gradients some input needs: the first convolution of a network, reading the
//! images, skips `dx` entirely. Gradients accumulate in the walk (`+=` semantics).

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `y[N, O, OH, OW] = conv(self[N, C, H, W], weight[O, C, KH, KW]) (+ bias[O])`, the same
    /// stride and zero padding along both axes.
    pub fn conv2d(&self, weight: &Var, bias: Option<&Var>, stride: usize, padding: usize) -> Result<Var> {
        let (x, w) = (self.value().contiguous()?, weight.value().contiguous()?);
        let b = bias.map(Var::value);
        let y = x.conv2d(&w, b.as_ref(), stride, padding)?;
        let needs = [self.requires_grad(), weight.requires_grad(), bias.is_some_and(Var::requires_grad)];
        let mut inputs = vec![self.clone(), weight.clone()];
        inputs.extend(bias.cloned());
        let has_bias = bias.is_some();
        Ok(Var::from_op(y, inputs, move |dy| {
            // d/dx = col2im(wᵀ·dy),  d/dw = Σ_n dy_n·col_nᵀ,  d/dbias = Σ_{n,p} dy
            let grads = Tensor::conv2d_backward(&x, &w, dy, stride, padding, needs)?;
            // An input that needs no gradient gets an empty placeholder the walk never reads.
            let placeholder = |g: Option<Tensor>| g.unwrap_or_else(|| Tensor::zeros(&[0]));
            let mut out = vec![placeholder(grads.x), placeholder(grads.weight)];
            if has_bias {
                out.push(placeholder(grads.bias));
            }
            Ok(out)
        }))
    }
}
