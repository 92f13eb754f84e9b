//! Views and concatenation: reshape, permute, transpose, narrow, expand, (un)squeeze, cat.
//! Their backward rules only move gradients back into the input's layout.

use tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// New shape, same elements (one dimension may be `usize::MAX` to infer it).
    pub fn reshape(&self, shape: &[usize]) -> Result<Var> {
        let input_shape = self.shape();
        let y = self.value_ref().reshape(shape)?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.reshape(&input_shape)?])))
    }

    /// Reorders dimensions.
    pub fn permute(&self, axes: &[usize]) -> Result<Var> {
        let y = self.value_ref().permute(axes)?;
        let mut inverse = vec![0; axes.len()];
        for (i, &a) in axes.iter().enumerate() {
            inverse[a] = i;
        }
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.permute(&inverse)?.contiguous()?])))
    }

    /// Swaps two dimensions.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Var> {
        let y = self.value_ref().transpose(a, b)?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.transpose(a, b)?.contiguous()?])))
    }

    /// The slice `start..start + len` of `axis`; backward pads the gradient with zeros.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Var> {
        let shape = self.shape();
        let y = self.value_ref().narrow(axis, start, len)?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| {
            let mut before = shape.clone();
            before[axis] = start;
            let mut after = shape.clone();
            after[axis] = shape[axis] - start - len;
            let (before, after) = (Tensor::zeros_on(&before, dy.device())?, Tensor::zeros_on(&after, dy.device())?);
            Ok(vec![Tensor::cat(&[&before, dy, &after], axis)?])
        }))
    }

    /// Broadcasts to `shape`; backward sums over the broadcast dimensions.
    pub fn expand(&self, shape: &[usize]) -> Result<Var> {
        let input_shape = self.shape();
        let y = self.value_ref().expand(shape)?;
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.sum_to_shape(&input_shape)?])))
    }

    /// Inserts a size-1 dimension.
    pub fn unsqueeze(&self, axis: usize) -> Result<Var> {
        let mut shape = self.shape();
        if axis > shape.len() {
            return Err(tensor::Error::AxisOutOfRange { op: "unsqueeze", axis, rank: shape.len() });
        }
        shape.insert(axis, 1);
        self.reshape(&shape)
    }

    /// Removes a size-1 dimension.
    pub fn squeeze(&self, axis: usize) -> Result<Var> {
        let shape = self.value_ref().squeeze(axis)?.shape().to_vec();
        self.reshape(&shape)
    }

    /// Joins `vars` along `axis`; backward hands each input its slice of the gradient.
    pub fn cat(vars: &[&Var], axis: usize) -> Result<Var> {
        let values: Vec<Tensor> = vars.iter().map(|v| v.value()).collect();
        let y = Tensor::cat(&values.iter().collect::<Vec<_>>(), axis)?;
        let sizes: Vec<usize> = values.iter().map(|v| v.shape()[axis]).collect();
        let inputs = vars.iter().map(|&v| v.clone()).collect();
        Ok(Var::from_op(y, inputs, move |dy| {
            let mut start = 0;
            let mut grads = Vec::with_capacity(sizes.len());
            for &size in &sizes {
                grads.push(dy.narrow(axis, start, size)?.contiguous()?);
                start += size;
            }
            Ok(grads)
        }))
    }
}
