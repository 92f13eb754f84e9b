//! The named choices of a training config (`optimizer`, `schedule`, `sampling`), parsed once —
//! from JSON by serde, from flags by [`std::str::FromStr`] — so the code that uses them
//! matches on enums, never on strings. Unknown names are errors listing the valid ones.

#[cfg(test)]
use std::fmt;

use serde::{Deserialize, Serialize};

/// The flag spelling of `value` in `table` (every variant is listed, so the lookup cannot
/// miss; an empty string would reveal a table missing one).
pub fn choice_name<T: PartialEq + Copy>(table: &[(&'static str, T)], value: T) -> &'static str {
    table.iter().find(|(_, v)| *v == value).map_or("", |(name, _)| name)
}

/// The variant `text` names in `table`, or an error naming `what` and listing the valid names.
pub fn parse_choice<T: Copy>(what: &str, table: &[(&'static str, T)], text: &str) -> Result<T, String> {
    table.iter().find(|(name, _)| *name == text).map(|(_, v)| *v).ok_or_else(|| {
        let valid: Vec<&str> = table.iter().map(|(name, _)| *name).collect();
        format!("unknown {what} `{text}`; valid: {}", valid.join(", "))
    })
}

/// The optimizer of a language-model run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter 2019).
    AdamW,
    /// Adam with L2 weight decay added to the gradient.
    Adam,
    /// SGD with momentum (`momentum`, `weight_decay`).
    Sgd,
}

impl OptimizerKind {
    /// Every optimizer with its name, in the order errors list them.
    pub const ALL: [(&'static str, OptimizerKind); 3] =
        [("adamw", OptimizerKind::AdamW), ("adam", OptimizerKind::Adam), ("sgd", OptimizerKind::Sgd)];
}

/// The learning-rate schedule of a language-model run (its parameters come from the config:
/// `warmup`, `steps`; see `TrainConfig::schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Linear warmup, then cosine decay to 0.1 × peak at the last step.
    Cosine,
    /// Linear warmup, then ∝ 1/√step (Vaswani et al. 2017).
    Noam,
    /// The peak rate throughout.
    Constant,
    /// Linear decay to 0.01 × peak at the last step.
    Linear,
    /// OneCycle (Smith 2018): up for 30% of the steps, then down.
    OneCycle,
}

impl ScheduleKind {
    /// Every schedule with its name, in the order errors list them.
    pub const ALL: [(&'static str, ScheduleKind); 5] = [
        ("cosine", ScheduleKind::Cosine),
        ("noam", ScheduleKind::Noam),
        ("constant", ScheduleKind::Constant),
        ("linear", ScheduleKind::Linear),
        ("onecycle", ScheduleKind::OneCycle),
    ];

    /// Whether the rate at a step depends on the run's total step count, so that changing
    /// `steps` reshapes the schedule (what a resumed run must be told).
    pub fn depends_on_total(self) -> bool {
        matches!(self, ScheduleKind::Cosine | ScheduleKind::Linear | ScheduleKind::OneCycle)
    }
}

/// How training batches are drawn from the token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    /// Windows at seeded uniformly random offsets (nanoGPT).
    Random,
    /// Consecutive windows, wrapping at the end (llm.c).
    Sequential,
}

impl Sampling {
    /// Every sampling with its name, in the order errors list them.
    pub const ALL: [(&'static str, Sampling); 2] = [("random", Sampling::Random), ("sequential", Sampling::Sequential)];
}

/// `name()`, `Display` and `FromStr` (what clap parses flags with) from a choice's `ALL` table.
macro_rules! named_choice {
    ($type:ty, $what:literal) => {
        impl $type {
            /// The name configs and flags use.
            pub fn name(self) -> &'static str {
                $crate::config::choices::choice_name(&Self::ALL, self)
            }
        }

        impl std::str::FromStr for $type {
            type Err = String;

            fn from_str(text: &str) -> Result<Self, String> {
                $crate::config::choices::parse_choice($what, &Self::ALL, text)
            }
        }

        impl std::fmt::Display for $type {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
pub(crate) use named_choice;

named_choice!(OptimizerKind, "optimizer");
named_choice!(ScheduleKind, "schedule");
named_choice!(Sampling, "sampling");

#[cfg(test)]
mod tests {
    use super::*;

    /// The serde names (configs) and the table names (flags, messages) must be the same.
    fn round_trips<T>(table: &[(&'static str, T)])
    where
        T: Copy + PartialEq + fmt::Debug + Serialize + for<'de> Deserialize<'de>,
    {
        for &(name, value) in table {
            assert_eq!(serde_json::to_string(&value).unwrap(), format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<T>(&format!("\"{name}\"")).unwrap(), value);
        }
    }

    #[test]
    fn serde_and_flag_names_agree() {
        round_trips(&OptimizerKind::ALL);
        round_trips(&ScheduleKind::ALL);
        round_trips(&Sampling::ALL);
        round_trips(&crate::data::DataFormat::ALL);
    }

    #[test]
    fn unknown_names_list_the_valid_ones() {
        let msg = "lion".parse::<OptimizerKind>().unwrap_err();
        assert!(msg.contains("optimizer `lion`") && msg.contains("adamw, adam, sgd"), "{msg}");
        assert_eq!("onecycle".parse::<ScheduleKind>(), Ok(ScheduleKind::OneCycle));
        assert_eq!(ScheduleKind::OneCycle.to_string(), "onecycle");
        let msg = serde_json::from_str::<Sampling>("\"shuffled\"").unwrap_err().to_string();
        assert!(msg.contains("shuffled") && msg.contains("sequential"), "{msg}");
    }
}
