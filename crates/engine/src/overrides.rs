//! `KEY=VALUE` overrides of a config file (`serve --set model.quick.scheduler_kwargs.p=0.3`):
//! one base config and a list of changes instead of copies of the YAML or string
//! replacement, which silently does nothing once the file changes. A path that does not
//! lead into the file is an error; the result goes through the same typed parse as a file,
//! so an unknown key or a bad value is reported as it would be there.

use std::path::Path;

use serde_yaml::{Mapping, Value};

use crate::config::{ConfigError, EngineConfig};

/// Sets `key` (dot-separated mapping keys) to `value` (a YAML value: `0.3`, `sync`, `{}`,
/// `[1, 2]`). Every mapping on the way must exist; the last key may be new.
pub fn apply_override(doc: &mut Value, assignment: &str) -> Result<(), String> {
    let (key, value) = assignment
        .split_once('=')
        .ok_or_else(|| format!("`{assignment}`: expected KEY=VALUE"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if key.is_empty() || parts.iter().any(|p| p.is_empty()) {
        return Err(format!(
            "`{assignment}`: the key must be like model.quick.dtype"
        ));
    }
    let value: Value = serde_yaml::from_str(value)
        .map_err(|e| format!("`{assignment}`: the value is not YAML: {e}"))?;
    let (last, path) = parts
        .split_last()
        .ok_or_else(|| format!("`{assignment}`: empty key"))?;
    let mut node = doc;
    for (depth, part) in path.iter().enumerate() {
        let here = parts[..=depth].join(".");
        node = match node {
            Value::Mapping(m) => m
                .get_mut(*part)
                .ok_or_else(|| format!("`{assignment}`: `{here}` is not in the config"))?,
            _ => return Err(format!("`{assignment}`: `{here}` is not a mapping")),
        };
    }
    match node {
        Value::Mapping(m) => {
            m.insert(Value::String((*last).to_string()), value);
            Ok(())
        }
        Value::Null => {
            let mut m = Mapping::new();
            m.insert(Value::String((*last).to_string()), value);
            *node = Value::Mapping(m);
            Ok(())
        }
        _ => Err(format!(
            "`{assignment}`: `{}` is not a mapping",
            path.join(".")
        )),
    }
}

impl EngineConfig {
    /// A config's text with `overrides` applied in order, then parsed as a file would be
    /// (`file` anchors relative paths and names the config in errors).
    pub fn from_yaml_with_overrides(
        text: &str,
        file: &Path,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        if overrides.is_empty() {
            return Self::from_yaml(text, file);
        }
        let invalid = |message: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            message,
        };
        let mut doc: Value = serde_yaml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        for o in overrides {
            apply_override(&mut doc, o).map_err(|m| invalid(format!("--set {m}")))?;
        }
        let text = serde_yaml::to_string(&doc).map_err(|e| invalid(e.to_string()))?;
        Self::from_yaml(&text, file)
    }

    /// A config file with `overrides` applied.
    pub fn from_file_with_overrides(
        path: &Path,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml_with_overrides(&text, path, overrides)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "model:
  quick:
    model_path: a.gguf
    scheduler_class: random_slm
    scheduler_kwargs: {p: 0.35, seed: 0}
  reference:
    model_path: b.gguf
    scheduler_class: random_llm
system:
  entry_model: quick
";

    fn with(overrides: &[&str]) -> Result<EngineConfig, ConfigError> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        EngineConfig::from_yaml_with_overrides(BASE, Path::new("/x/base.yaml"), &o)
    }

    #[test]
    fn overrides_change_values_and_add_keys() {
        let cfg = with(&[
            "model.quick.scheduler_kwargs.p=0.7",
            "system.execution=sync",
            "model.reference.delayed_batching_threshold=[1, 2]",
        ])
        .expect("valid overrides");
        let kwargs = &cfg.models[0].section.scheduler_kwargs;
        assert_eq!(kwargs.get("p").and_then(|v| v.as_f64()), Some(0.7));
        assert_eq!(kwargs.get("seed").and_then(|v| v.as_u64()), Some(0));
        assert_eq!(cfg.system.execution, crate::Execution::Sync);
        assert_eq!(
            cfg.models[1].section.delayed_batching_threshold,
            crate::Threshold::PerConcurrency(vec![1, 2])
        );
        let cleared = with(&[
            "model.quick.scheduler_class=slm_only",
            "model.quick.scheduler_kwargs={}",
            "model.reference.scheduler_class=slm_only",
        ])
        .expect("valid");
        assert!(cleared.models[0]
            .section
            .scheduler_kwargs
            .as_mapping()
            .is_some_and(|m| m.is_empty()));
    }

    #[test]
    fn a_path_outside_the_file_or_a_bad_key_is_an_error() {
        for (o, expected) in [
            (
                "model.quik.scheduler_kwargs.p=1",
                "`model.quik` is not in the config",
            ),
            (
                "model.quick.scheduler_class.x=1",
                "`model.quick.scheduler_class` is not a mapping",
            ),
            ("system.execution", "expected KEY=VALUE"),
            ("model..p=1", "the key must be like"),
            ("system.no_such_key=1", "no_such_key"),
            ("system.execution=sideways", "sideways"),
        ] {
            let err = with(&[o]).unwrap_err().to_string();
            assert!(err.contains(expected), "{o}: {err}");
        }
    }
}
