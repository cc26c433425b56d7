//! Seeded synthetic traces with the Alibaba columns but other request mixes, so that a
//! placement is judged on more than the one trace it was tuned on.
//!
//! [`generate`] draws `n` requests of a [`Mix`] from a seed (splitmix64; the same seed
//! gives the same trace on every platform). Durations are log-uniform from 10 minutes to
//! 1 day. Arrivals are Poisson, or bursty (bursts of 5 to 20 requests 1 to 10 s apart,
//! the gaps between bursts exponential), at a rate that keeps `load_gpus` GPUs of demand
//! running on average (demand: `num_gpu` for whole GPUs, `gpu_milli / 1000` for a
//! fraction), so one to four 8-GPU nodes contend and eight barely do at the default 40.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::replay::{Trace, TraceError, TraceRequest};

/// The shared Alibaba pod lists of the family, in `data/alibaba-gpu-v2023`.
pub const SHARED_LISTS: [&str; 3] = [
    "openb_pod_list_default.csv",
    "openb_pod_list_gpushare100.csv",
    "openb_pod_list_multigpu50.csv",
];

/// Shortest and longest duration, seconds.
const DURATION_S: (f64, f64) = (600.0, 86_400.0);
/// Average GPUs of demand running, by default.
pub const DEFAULT_LOAD_GPUS: f64 = 40.0;

/// The request mixes of the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mix {
    /// Close to the Alibaba default list: half fractions (many 0.46–0.5), a third whole
    /// single GPUs, a few 2/4/8-GPU tasks; Poisson arrivals.
    AlibabaLike,
    /// The mix: mostly mid-size fractions (0.3–0.7) and whole GPUs, 2- and
    /// 4-GPU tasks, bursty arrivals.
    MidWholeBursty,
    /// Mostly small fractions (0.05–0.3, log-uniform), some whole GPUs; Poisson.
    SmallShares,
    /// Multi-GPU heavy: 2/4/8-GPU tasks and fractions of any size; bursty.
    MultiGpu,
    /// Fractions uniform over 0.001–1.0 and some whole GPUs; Poisson.
    Uniform,
}

impl Mix {
    pub const ALL: [Mix; 5] =
        [Mix::AlibabaLike, Mix::MidWholeBursty, Mix::SmallShares, Mix::MultiGpu, Mix::Uniform];

    pub fn as_str(&self) -> &'static str {
        match self {
            Mix::AlibabaLike => "alibaba-like",
            Mix::MidWholeBursty => "mid-whole-bursty",
            Mix::SmallShares => "small-shares",
            Mix::MultiGpu => "multi-gpu",
            Mix::Uniform => "uniform",
        }
    }

    fn bursty(&self) -> bool {
        matches!(self, Mix::MidWholeBursty | Mix::MultiGpu)
    }

    /// One request's (num_gpu, gpu_milli).
    fn draw(&self, r: &mut Rng) -> (u32, u32) {
        let u = r.unit();
        match self {
            Mix::AlibabaLike => {
                if u < 0.55 {
                    const MILLI: [u32; 10] = [100, 200, 250, 300, 460, 460, 500, 500, 800, 900];
                    (1, MILLI[r.below(MILLI.len() as u64) as usize])
                } else if u < 0.90 {
                    (1, 1000)
                } else if u < 0.95 {
                    (2, 1000)
                } else if u < 0.98 {
                    (4, 1000)
                } else {
                    (8, 1000)
                }
            }
            Mix::MidWholeBursty => {
                if u < 0.45 {
                    (1, 300 + r.below(401) as u32)
                } else if u < 0.85 {
                    (1, 1000)
                } else if u < 0.95 {
                    (2, 1000)
                } else {
                    (4, 1000)
                }
            }
            Mix::SmallShares => {
                if u < 0.85 {
                    let m = (50.0f64.ln() + r.unit() * (300.0f64.ln() - 50.0f64.ln())).exp();
                    (1, m.round() as u32)
                } else {
                    (1, 1000)
                }
            }
            Mix::MultiGpu => {
                if u < 0.3 {
                    (1, 100 + r.below(800) as u32)
                } else if u < 0.5 {
                    (1, 1000)
                } else if u < 0.7 {
                    (2, 1000)
                } else if u < 0.9 {
                    (4, 1000)
                } else {
                    (8, 1000)
                }
            }
            Mix::Uniform => {
                if u < 0.8 {
                    (1, 1 + r.below(1000) as u32)
                } else {
                    (1 + r.below(2) as u32, 1000)
                }
            }
        }
    }
}

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mix {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mix::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = Mix::ALL.iter().map(|m| m.as_str()).collect();
            format!("`{s}` is not a generated mix: {}", names.join(", "))
        })
    }
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// Exponential with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// The trace family the placements are compared on: the [`SHARED_LISTS`] read from
/// `shared_dir` (None: without them), then every [`Mix`] with `n` requests from `seed`.
pub fn family(shared_dir: Option<&Path>, n: usize, seed: u64) -> Result<Vec<Trace>, TraceError> {
    let mut traces = Vec::new();
    if let Some(dir) = shared_dir {
        for f in SHARED_LISTS {
            traces.push(Trace::load_alibaba(&dir.join(f))?);
        }
    }
    traces.extend(Mix::ALL.into_iter().map(|mix| generate(mix, n, seed, DEFAULT_LOAD_GPUS)));
    Ok(traces)
}

/// `n` requests of `mix` from `seed`, keeping `load_gpus` GPUs of demand running on
/// average (see the module documentation).
pub fn generate(mix: Mix, n: usize, seed: u64, load_gpus: f64) -> Trace {
    let mut r = Rng(seed ^ 0x7e55_e7a0_0000_0000 ^ (mix as u64) << 8);
    let (lo, hi) = (DURATION_S.0.ln(), DURATION_S.1.ln());
    let shapes: Vec<((u32, u32), u64)> = (0..n)
        .map(|_| {
            let shape = mix.draw(&mut r);
            let d = (lo + r.unit() * (hi - lo)).exp().round() as u64;
            (shape, d)
        })
        .collect();
    // Mean demand × mean duration / load = mean gap between arrivals.
    let gpu_seconds: f64 = shapes
        .iter()
        .map(|((g, m), d)| {
            let demand = if *g >= 2 || *m >= 1000 { f64::from(*g) } else { f64::from(*m) / 1000.0 };
            demand * *d as f64
        })
        .sum();
    let gap = if n == 0 || load_gpus <= 0.0 { 0.0 } else { gpu_seconds / n as f64 / load_gpus };
    let mut t = 0.0f64;
    let mut burst_left = 0u64;
    let mut requests = Vec::with_capacity(n);
    for (i, ((num_gpu, gpu_milli), duration)) in shapes.into_iter().enumerate() {
        if mix.bursty() {
            if burst_left == 0 {
                let size = 5 + r.below(16);
                // The burst's requests come ~5 s apart; the gap before it keeps the rate.
                t += r.exp((gap * size as f64 - 5.0 * size as f64).max(0.0));
                burst_left = size;
            } else {
                t += 1.0 + r.below(10) as f64;
            }
            burst_left -= 1;
        } else {
            t += r.exp(gap);
        }
        let arrival = t.round() as u64;
        requests.push(TraceRequest {
            name: format!("gen-{}-{i}", mix.as_str()),
            num_gpu,
            gpu_milli,
            arrival,
            departure: arrival + duration,
        });
    }
    Trace { source: format!("{mix} (seed {seed}, {n} requests)"), requests, synthetic_times: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_traces_are_seeded_and_shaped() {
        for mix in Mix::ALL {
            let a = generate(mix, 2000, 7, DEFAULT_LOAD_GPUS);
            assert_eq!(a, generate(mix, 2000, 7, DEFAULT_LOAD_GPUS), "{mix}: deterministic");
            assert_ne!(a, generate(mix, 2000, 8, DEFAULT_LOAD_GPUS), "{mix}: the seed matters");
            assert_eq!(mix.as_str().parse::<Mix>(), Ok(mix));
            assert!(a.requests.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            let mut demand = 0.0;
            for q in &a.requests {
                let d = q.departure - q.arrival;
                assert!((600..=86_400).contains(&d), "{mix}: duration {d}");
                assert!(q.num_gpu >= 1 && (1..=1000).contains(&q.gpu_milli), "{mix}: {q:?}");
                demand += if q.gpu_milli >= 1000 {
                    f64::from(q.num_gpu)
                } else {
                    f64::from(q.gpu_milli) / 1000.0
                } * d as f64;
            }
            // Average demand running over the arrival span: about the load asked for.
            let span = a.requests.last().map_or(1, |q| q.arrival).max(1) as f64;
            let load = demand / span;
            assert!((25.0..=60.0).contains(&load), "{mix}: load {load:.1}");
        }
        let fractions = |m: Mix| {
            let t = generate(m, 2000, 1, DEFAULT_LOAD_GPUS);
            t.requests.iter().filter(|q| q.gpu_milli < 1000).count() as f64 / 2000.0
        };
        assert!(fractions(Mix::SmallShares) > 0.8);
        assert!(fractions(Mix::MultiGpu) < 0.4);
        assert!("big".parse::<Mix>().is_err());
    }
}
