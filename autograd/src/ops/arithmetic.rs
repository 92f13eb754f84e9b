//! Broadcasting binary ops and scalar ops. Gradients of broadcast operands are summed
//! back to the operand's shape (`sum_to_shape`).

use tensor::ops::Binary;
use tensor::{Device, Result, Tensor};

use crate::Var;

impl Var {
    /// `self + rhs` (broadcasting).
    pub fn add(&self, rhs: &Var) -> Result<Var> {
        let (a_shape, b_shape) = (self.shape(), rhs.shape());
        let y = self.value_ref().add(&rhs.value_ref())?;
        // d(a+b)/da = 1, d(a+b)/db = 1
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            Ok(vec![dy.sum_to_shape(&a_shape)?, dy.sum_to_shape(&b_shape)?])
        }))
    }

    /// `self - rhs` (broadcasting).
    pub fn sub(&self, rhs: &Var) -> Result<Var> {
        let (a_shape, b_shape) = (self.shape(), rhs.shape());
        let y = self.value_ref().sub(&rhs.value_ref())?;
        // d(a-b)/da = 1, d(a-b)/db = -1
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            Ok(vec![dy.sum_to_shape(&a_shape)?, dy.scalar_op(Binary::Mul, -1.0)?.sum_to_shape(&b_shape)?])
        }))
    }

    /// `self * rhs` elementwise (broadcasting).
    pub fn mul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.mul(&b)?;
        // d(a·b)/da = b, d(a·b)/db = a
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            Ok(vec![dy.mul(&b)?.sum_to_shape(a.shape())?, dy.mul(&a)?.sum_to_shape(b.shape())?])
        }))
    }

    /// `self / rhs` elementwise (broadcasting).
    pub fn div(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.div(&b)?;
        // d(a/b)/da = 1/b, d(a/b)/db = -a/b² = -y/b
        let y_saved = y.clone();
        Ok(Var::from_op(y, vec![self.clone(), rhs.clone()], move |dy| {
            let da = dy.div(&b)?.sum_to_shape(a.shape())?;
            let db = dy.mul(&y_saved)?.div(&b)?.scalar_op(Binary::Mul, -1.0)?.sum_to_shape(b.shape())?;
            Ok(vec![da, db])
        }))
    }

    /// Elementwise maximum (broadcasting). At ties the gradient is split evenly, as PyTorch does.
    pub fn maximum(&self, rhs: &Var) -> Result<Var> {
        self.extremum(rhs, Binary::Maximum)
    }

    /// Elementwise minimum (broadcasting). At ties the gradient is split evenly.
    pub fn minimum(&self, rhs: &Var) -> Result<Var> {
        self.extremum(rhs, Binary::Minimum)
    }

    fn extremum(&self, rhs: &Var, op: Binary) -> Result<Var> {
        let (a, b) = (self.value(), rhs.value());
        let y = a.binary(&b, op)?;
        // d max(a,b)/da = [a wins] + ½[a = b]; the loser gets nothing.
        Ok(Var::from_op(y.clone(), vec![self.clone(), rhs.clone()], move |dy| {
            let share_a =
                if y.device() == Device::Cpu { share_on_host(&a, &b, &y)? } else { share_by_ops(&a, &b, &y)? };
            let da = dy.mul(&share_a)?;
            let db = dy.sub(&da)?;
            Ok(vec![da.sum_to_shape(a.shape())?, db.sum_to_shape(b.shape())?])
        }))
    }

    /// `self + s` for a scalar `s`.
    pub fn add_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value_ref().scalar_op(Binary::Add, s)?;
        // d(x+s)/dx = 1
        Ok(Var::from_op(y, vec![self.clone()], |dy| Ok(vec![dy.clone()])))
    }

    /// `self · s` for a scalar `s`.
    pub fn mul_scalar(&self, s: f32) -> Result<Var> {
        let y = self.value_ref().scalar_op(Binary::Mul, s)?;
        // d(x·s)/dx = s
        Ok(Var::from_op(y, vec![self.clone()], move |dy| Ok(vec![dy.scalar_op(Binary::Mul, s)?])))
    }
}

/// `a`'s share of the gradient of `y = max(a, b)` (or min), elementwise over `y`'s shape:
/// ½ where `a = b`, 1 where `a = y` otherwise, else 0 (a loop on the host).
fn share_on_host(a: &Tensor, b: &Tensor, y: &Tensor) -> Result<Tensor> {
    let a_full = a.expand(y.shape())?.to_vec();
    let y_full = y.to_vec();
    let b_full = b.expand(y.shape())?.to_vec();
    let share_a: Vec<f32> = a_full
        .iter()
        .zip(&b_full)
        .zip(&y_full)
        .map(|((&x, &z), &m)| {
            if x == z {
                0.5
            } else if x == m {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(share_a, y.shape())
}

/// [`share_on_host`] from tensor ops, so it runs where the tensors are (a GPU):
/// `½·[a = b] + (1 − [a = b])·[a = y]`.
fn share_by_ops(a: &Tensor, b: &Tensor, y: &Tensor) -> Result<Tensor> {
    let tie = equal(a, b)?;
    let won = equal(a, y)?;
    let not_tie = tie.scalar_op(Binary::Mul, -1.0)?.scalar_op(Binary::Add, 1.0)?;
    tie.scalar_op(Binary::Mul, 0.5)?.add(&not_tie.mul(&won)?)
}

/// 1 where `u == v` (IEEE: NaN equals nothing, ∞ equals ∞), else 0, broadcast; from tensor
/// ops only. `select(c, p, q)` picks `p` where `c ≠ 0`, and NaN counts as nonzero.
fn equal(u: &Tensor, v: &Tensor) -> Result<Tensor> {
    let device = u.device();
    let (one, zero) = (Tensor::full_on(&[], 1.0, device)?, Tensor::zeros_on(&[], device)?);
    let is_zero = |c: &Tensor| Tensor::select(c, &zero, &one);
    let nonzero = |c: &Tensor| Tensor::select(c, &one, &zero);
    // Unless both are infinite, u − v is exactly 0 iff u = v (subnormals are kept), and
    // ±∞ or NaN when either is infinite or NaN.
    let difference_zero = is_zero(&u.sub(v)?)?;
    // x·0 is NaN for ±∞ and NaN, ±0 for finite x.
    let both_non_finite = nonzero(&u.scalar_op(Binary::Mul, 0.0)?)?.mul(&nonzero(&v.scalar_op(Binary::Mul, 0.0)?)?)?;
    // For two non-finite values, min(u·v, 0) is 0 only when u·v = +∞: equal infinities
    // (−∞ for opposite signs, NaN when either is NaN).
    let same_infinity = is_zero(&u.mul(v)?.binary(&zero, Binary::Minimum)?)?;
    difference_zero.add(&both_non_finite.mul(&same_infinity)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-op share (the GPU path) equals the host loop's on every kind of value.
    /// One pair per tensor: fewer than 8 elements take the CPU select's scalar path, whose
    /// NaN condition counts as true like the GPU kernel's (its SIMD path counts it false).
    #[test]
    fn share_by_ops_matches_the_host_rule() {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let special = [0.0, -0.0, 1.0, -1.0, 2.5, 1e-40, -1e-40, 3e38, inf, -inf, nan];
        for op in [Binary::Maximum, Binary::Minimum] {
            for &x in &special {
                for &z in &special {
                    let (a, b) = (Tensor::from_vec(vec![x], &[1]).unwrap(), Tensor::from_vec(vec![z], &[1]).unwrap());
                    let y = a.binary(&b, op).unwrap();
                    let host = share_on_host(&a, &b, &y).unwrap().to_vec();
                    assert_eq!(share_by_ops(&a, &b, &y).unwrap().to_vec(), host, "{op:?}({x}, {z})");
                }
            }
        }
        // Broadcast operands: a [2, 1] against b [3].
        let a = Tensor::from_vec(vec![1.0, inf], &[2, 1]).unwrap();
        let b = Tensor::from_vec(vec![1.0, inf, 0.0], &[3]).unwrap();
        let y = a.binary(&b, Binary::Maximum).unwrap();
        assert_eq!(share_by_ops(&a, &b, &y).unwrap().to_vec(), share_on_host(&a, &b, &y).unwrap().to_vec());
    }
}
