//! Small dense linear algebra in f64 for the analyses: the symmetric eigen-decomposition
//! (cyclic Jacobi), singular values from a Gram matrix, and the effective rank.
//!
//! Singular values of a stack `M: [T, D]` (T operators, each vectorised to D numbers) are the
//! square roots of the eigenvalues of its Gram matrix `G = M·Mᵀ: [T, T]`, so an SVD of a
//! T × D matrix with D ≫ T costs one T × T eigenproblem. Jacobi is slow (O(T³) per sweep)
//! but simple, unconditionally stable, and accurate for small eigenvalues of a PSD matrix:
//! enough for T ≤ a few hundred.

/// Eigenvalues (descending) and eigenvectors (`vectors[i]` belongs to `values[i]`) of the
/// symmetric `n × n` row-major matrix `a`.
pub struct Eigen {
    /// The eigenvalues, largest first.
    pub values: Vec<f64>,
    /// Unit eigenvectors, one per eigenvalue, in the same order.
    pub vectors: Vec<Vec<f64>>,
}

/// Sweeps after which Jacobi stops even if not converged (it converges quadratically; 30 is
/// never reached in practice for n ≤ 1000).
const MAX_SWEEPS: usize = 30;

/// Cyclic Jacobi: rotate away each off-diagonal element in turn until the off-diagonal mass
/// is below `1e-15 ×` the total. `a` must be symmetric; only its values are read.
pub fn symmetric_eigen(a: &[f64], n: usize) -> Eigen {
    assert_eq!(a.len(), n * n, "symmetric_eigen: {} values for {n} × {n}", a.len());
    let mut m = a.to_vec();
    // v holds the accumulated rotations; its columns become the eigenvectors.
    let mut v = vec![0.0; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let total: f64 = m.iter().map(|x| x * x).sum();
    for _ in 0..MAX_SWEEPS {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| m[i * n + j].powi(2))
            .sum();
        if off <= 1e-30 * total.max(f64::MIN_POSITIVE) {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = m[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                // The rotation angle that zeroes m[p][q] (Golub & Van Loan, Algorithm 8.4.1).
                let theta = (m[q * n + q] - m[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (mkp, mkq) = (m[k * n + p], m[k * n + q]);
                    m[k * n + p] = c * mkp - s * mkq;
                    m[k * n + q] = s * mkp + c * mkq;
                }
                for k in 0..n {
                    let (mpk, mqk) = (m[p * n + k], m[q * n + k]);
                    m[p * n + k] = c * mpk - s * mqk;
                    m[q * n + k] = s * mpk + c * mqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| m[j * n + j].total_cmp(&m[i * n + i]));
    Eigen {
        values: order.iter().map(|&i| m[i * n + i]).collect(),
        vectors: order.iter().map(|&i| (0..n).map(|k| v[k * n + i]).collect()).collect(),
    }
}

/// `G = M·Mᵀ` for `rows` vectors of equal length, in f64.
pub fn gram(rows: &[Vec<f64>]) -> Vec<f64> {
    let n = rows.len();
    let mut g = vec![0.0; n * n];
    for i in 0..n {
        for j in i..n {
            let dot: f64 = rows[i].iter().zip(&rows[j]).map(|(a, b)| a * b).sum();
            g[i * n + j] = dot;
            g[j * n + i] = dot;
        }
    }
    g
}

/// Singular values (descending) of the matrix whose Gram matrix is `g: [n, n]`; eigenvalues
/// rounded below zero are clamped to 0.
pub fn singular_values_from_gram(g: &[f64], n: usize) -> Vec<f64> {
    symmetric_eigen(g, n).values.into_iter().map(|l| l.max(0.0).sqrt()).collect()
}

/// Effective rank (Roy & Vetterli 2007): `exp(H(p))`, `p_i = σ_i / Σ σ`, H in nats. 1 for a
/// rank-one spectrum, n for n equal singular values; 0 for an all-zero spectrum.
pub fn effective_rank(singular_values: &[f64]) -> f64 {
    let total: f64 = singular_values.iter().sum();
    if total <= 0.0 {
        return 0.0;
    }
    let entropy: f64 = singular_values.iter().map(|s| s / total).filter(|&p| p > 0.0).map(|p| -p * p.ln()).sum();
    entropy.exp()
}

/// Singular values above `1e-6 ×` the largest: the numerical rank. Singular values taken
/// from a Gram matrix carry an error near `√ε ≈ 1e-8` of the largest, so the threshold sits
/// well above that floor.
pub fn numerical_rank(singular_values: &[f64]) -> usize {
    let largest = singular_values.first().copied().unwrap_or(0.0);
    singular_values.iter().filter(|&&s| s > 1e-6 * largest).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eigen_of_a_known_matrix() {
        // [[2, 1], [1, 2]]: eigenvalues 3 and 1, vectors (1, 1)/√2 and (1, −1)/√2.
        let e = symmetric_eigen(&[2.0, 1.0, 1.0, 2.0], 2);
        assert!((e.values[0] - 3.0).abs() < 1e-12 && (e.values[1] - 1.0).abs() < 1e-12);
        let v = &e.vectors[0];
        assert!((v[0].abs() - 0.5f64.sqrt()).abs() < 1e-12 && (v[0] - v[1]).abs() < 1e-12);
    }

    #[test]
    fn reconstructs_a_random_symmetric_matrix() {
        let n = 12;
        let mut rng = tensor::Rng::new(4);
        let mut a = vec![0.0; n * n];
        for i in 0..n {
            for j in i..n {
                let x = rng.normal() as f64;
                a[i * n + j] = x;
                a[j * n + i] = x;
            }
        }
        let e = symmetric_eigen(&a, n);
        for i in 0..n {
            for j in 0..n {
                let back: f64 = (0..n).map(|k| e.values[k] * e.vectors[k][i] * e.vectors[k][j]).sum();
                assert!((back - a[i * n + j]).abs() < 1e-10, "({i}, {j}): {back} vs {}", a[i * n + j]);
            }
        }
        assert!(e.values.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn singular_values_and_effective_rank() {
        // Rows e1, 2·e2, 2·e2: singular values 2√2, 1, 0.
        let rows = vec![vec![1.0, 0.0, 0.0], vec![0.0, 2.0, 0.0], vec![0.0, 2.0, 0.0]];
        let s = singular_values_from_gram(&gram(&rows), 3);
        assert!((s[0] - 8f64.sqrt()).abs() < 1e-12 && (s[1] - 1.0).abs() < 1e-12 && s[2].abs() < 1e-6);
        assert_eq!(numerical_rank(&s), 2);
        assert!((effective_rank(&[1.0, 0.0]) - 1.0).abs() < 1e-12);
        assert!((effective_rank(&[3.0; 5]) - 5.0).abs() < 1e-12);
        let r = effective_rank(&s);
        assert!(r > 1.0 && r < 2.0, "{r}");
    }
}
