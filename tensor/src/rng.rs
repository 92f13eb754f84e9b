//! The engine's random number generator: xoshiro256** seeded through SplitMix64.
//!
//! Documented and self-contained so that a seed reproduces bit for bit on every machine
//! and version (no dependency whose stream could change). Normals use Box-Muller.

/// Deterministic PRNG (xoshiro256**, Blackman & Vigna 2018).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: [u64; 4],
}

impl Rng {
    /// Seeds the four state words with SplitMix64 from `seed` (the authors' recommendation).
    pub fn new(seed: u64) -> Rng {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { state: [next(), next(), next(), next()] }
    }

    /// The raw state, for checkpoints (restore with [`Rng::from_state`]).
    pub fn state(&self) -> [u64; 4] {
        self.state
    }

    /// Restores a generator saved with [`Rng::state`].
    pub fn from_state(state: [u64; 4]) -> Rng {
        Rng { state }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 24 bits of mantissa.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [low, high).
    pub fn uniform_range(&mut self, low: f32, high: f32) -> f32 {
        low + (high - low) * self.uniform()
    }

    /// Uniform integer in [0, n) (n > 0), by rejection-free multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Standard normal (Box-Muller; one of the pair is discarded to keep the stream simple).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let u2 = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        let radius = (-2.0 * (1.0 - u1).ln()).sqrt();
        (radius * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_state_round_trip() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = Rng::from_state(a.state());
        assert_eq!(a.uniform(), c.uniform());
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }

    #[test]
    fn moments_are_plausible() {
        let mut rng = Rng::new(7);
        let n = 20000;
        let xs: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f32>() / n as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        let u: Vec<f32> = (0..n).map(|_| rng.uniform()).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
    }
}
