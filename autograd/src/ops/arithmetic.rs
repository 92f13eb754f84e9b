//! Broadcasting binary ops and scalar ops. Gradients of broadcast operands are summed
//! back to the operand's shape (`sum_to_shape`).

use tensor::ops::Binary;
use tensor::{Result, Tensor};

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
            let share_a = Tensor::from_vec(share_a, y.shape())?;
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
