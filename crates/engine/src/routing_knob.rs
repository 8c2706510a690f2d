//! The per-request routing knob: which kwargs a request may override in `"routing": {...}`
//! and within which range. The serving policies declare their tunables
//! (`Policy::tunables`); the config may switch the knob off or narrow a range
//! (`system.request_routing`). Checked once at submission, so a policy reading
//! `RowView::kwarg` only ever sees values it accepts.

use crate::config::{ConfigError, RequestRouting};
use crate::policy::Tunable;
use std::collections::BTreeMap;
use std::path::Path;
use tokenrouter_api::{RoutingOverrides, SubmitError};

/// The merged tunables of every model's policy, with the config's bounds applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Tunables {
    enabled: bool,
    /// key -> [min, max] (inclusive).
    ranges: BTreeMap<&'static str, (f64, f64)>,
    /// `system.request_routing.fim`, checked against the ranges.
    fim: RoutingOverrides,
}

impl Tunables {
    /// Merge the policies' tunables (a key several policies read must suit all of them:
    /// the ranges intersect) and apply `system.request_routing.bounds`.
    pub fn new(
        declared: Vec<Tunable>,
        config: &RequestRouting,
        file: &Path,
    ) -> Result<Self, ConfigError> {
        let mut ranges: BTreeMap<&'static str, (f64, f64)> = BTreeMap::new();
        for t in declared {
            let r = ranges.entry(t.key).or_insert((t.min, t.max));
            *r = (r.0.max(t.min), r.1.min(t.max));
        }
        for (key, [lo, hi]) in &config.bounds {
            let invalid = |message: String| ConfigError::Invalid {
                file: file.to_path_buf(),
                message: format!("system.request_routing.bounds.{key}: {message}"),
            };
            let Some(r) = ranges.get_mut(key.as_str()) else {
                return Err(invalid(format!(
                    "no configured routing method has a tunable `{key}` (tunable: {})",
                    list(ranges.keys().copied())
                )));
            };
            if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
                return Err(invalid(format!("[{lo}, {hi}] is not a range")));
            }
            if *lo < r.0 || *hi > r.1 {
                return Err(invalid(format!(
                    "[{lo}, {hi}] goes beyond what the method accepts, [{}, {}]",
                    r.0, r.1
                )));
            }
            *r = (*lo, *hi);
        }
        let fim = RoutingOverrides(config.fim.clone());
        check_ranges(&ranges, &fim).map_err(|e| ConfigError::Invalid {
            file: file.to_path_buf(),
            message: format!("system.request_routing.fim: {e}"),
        })?;
        Ok(Self {
            enabled: config.enabled,
            ranges,
            fim,
        })
    }

    /// The overrides a fill-in-the-middle request gets when it gives none.
    pub fn fim(&self) -> &RoutingOverrides {
        &self.fim
    }

    /// 400 naming the field for an unknown key, a value out of range, or any override when
    /// the knob is off.
    pub fn check(&self, routing: &RoutingOverrides) -> Result<(), SubmitError> {
        if routing.is_empty() {
            return Ok(());
        }
        // The server's own defaults for fill-in-the-middle requests pass even when clients
        // may not override (they were checked when the config was read).
        if !self.enabled && *routing != self.fim {
            return Err(SubmitError::InvalidField {
                param: "routing".into(),
                message: "this server does not accept per-request routing overrides \
                          (system.request_routing.enabled: false)"
                    .into(),
            });
        }
        check_ranges(&self.ranges, routing)
    }
}

/// Each key of `routing` is a tunable and its value within that tunable's range.
fn check_ranges(
    ranges: &BTreeMap<&'static str, (f64, f64)>,
    routing: &RoutingOverrides,
) -> Result<(), SubmitError> {
    for (key, &value) in &routing.0 {
        let shown: String = key.chars().take(64).collect();
        let param = format!("routing.{shown}");
        let Some(&(lo, hi)) = ranges.get(key.as_str()) else {
            let known = if ranges.is_empty() {
                "none".to_string()
            } else {
                list(ranges.keys().copied())
            };
            return Err(SubmitError::InvalidField {
                message: format!(
                    "`{param}`: the configured routing method has no tunable `{shown}` \
                     (tunable per request: {known})"
                ),
                param,
            });
        };
        if !(value.is_finite() && (lo..=hi).contains(&value)) {
            return Err(SubmitError::InvalidField {
                message: format!("`{param}` must be in [{lo}, {hi}], got {value}"),
                param,
            });
        }
    }
    Ok(())
}

fn list<'a>(keys: impl Iterator<Item = &'a str>) -> String {
    keys.collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overrides(pairs: &[(&str, f64)]) -> RoutingOverrides {
        RoutingOverrides(pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    fn rstitch() -> Vec<Tunable> {
        vec![Tunable::unit("threshold"), Tunable::unit("threshold")]
    }

    #[test]
    fn accepts_within_range_rejects_unknown_and_out_of_range() {
        let t = Tunables::new(rstitch(), &RequestRouting::default(), Path::new("x")).unwrap();
        assert!(t.check(&overrides(&[])).is_ok());
        assert!(t.check(&overrides(&[("threshold", 0.25)])).is_ok());
        match t.check(&overrides(&[("p", 0.2)])) {
            Err(SubmitError::InvalidField { param, message }) => {
                assert_eq!(param, "routing.p");
                assert!(message.contains("threshold"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        match t.check(&overrides(&[("threshold", 1.5)])) {
            Err(SubmitError::InvalidField { param, message }) => {
                assert_eq!(param, "routing.threshold");
                assert!(message.contains("[0, 1]"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn config_narrows_or_disables() {
        let cfg = RequestRouting {
            enabled: true,
            bounds: [("threshold".to_string(), [0.05, 0.5])].into(),
            fim: BTreeMap::new(),
        };
        let t = Tunables::new(rstitch(), &cfg, Path::new("x")).unwrap();
        assert!(t.check(&overrides(&[("threshold", 0.6)])).is_err());
        assert!(t.check(&overrides(&[("threshold", 0.05)])).is_ok());
        let off = RequestRouting {
            enabled: false,
            bounds: BTreeMap::new(),
            fim: BTreeMap::new(),
        };
        let t = Tunables::new(rstitch(), &off, Path::new("x")).unwrap();
        assert!(t.check(&overrides(&[("threshold", 0.2)])).is_err());
        assert!(t.check(&overrides(&[])).is_ok());
    }

    #[test]
    fn bad_bounds_are_config_errors() {
        let wide = RequestRouting {
            enabled: true,
            bounds: [("threshold".to_string(), [-1.0, 0.5])].into(),
            fim: BTreeMap::new(),
        };
        let e = Tunables::new(rstitch(), &wide, Path::new("c.yaml")).unwrap_err();
        assert!(
            e.to_string().contains("request_routing.bounds.threshold"),
            "{e}"
        );
        let unknown = RequestRouting {
            enabled: true,
            bounds: [("tau".to_string(), [0.0, 0.5])].into(),
            fim: BTreeMap::new(),
        };
        assert!(Tunables::new(rstitch(), &unknown, Path::new("c.yaml")).is_err());
    }

    #[test]
    fn fim_defaults_are_checked_and_pass_when_clients_may_not_override() {
        let fim = |enabled: bool, pairs: &[(&str, f64)]| RequestRouting {
            enabled,
            bounds: [("threshold".to_string(), [0.01, 0.5])].into(),
            fim: overrides(pairs).0,
        };
        let t = Tunables::new(
            rstitch(),
            &fim(false, &[("threshold", 0.03)]),
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(t.fim(), &overrides(&[("threshold", 0.03)]));
        assert!(t.check(t.fim()).is_ok());
        assert!(t.check(&overrides(&[("threshold", 0.2)])).is_err());
        for bad in [
            &[("threshold", 0.6)][..],
            &[("tau", 0.1)][..],
            &[("threshold", 0.001)][..],
        ] {
            let e = Tunables::new(rstitch(), &fim(true, bad), Path::new("c.yaml")).unwrap_err();
            assert!(e.to_string().contains("system.request_routing.fim"), "{e}");
        }
    }

    #[test]
    fn ranges_of_several_policies_intersect() {
        let declared = vec![
            Tunable::unit("threshold"),
            Tunable {
                key: "threshold",
                min: 0.2,
                max: 3.0,
            },
        ];
        let t = Tunables::new(declared, &RequestRouting::default(), Path::new("x")).unwrap();
        assert!(t.check(&overrides(&[("threshold", 0.1)])).is_err());
        assert!(t.check(&overrides(&[("threshold", 0.9)])).is_ok());
    }
}
