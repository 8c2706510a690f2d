//! Calibration: the sweep point a quality or cost target calls for (`eval --target`), and
//! the `scheduler_kwargs` line it prints for the config.

use crate::report::VariantSummary;
use crate::run::Role;

/// A quality or cost target for calibration.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// pass@1 ≥ this fraction of the large model's.
    RelativePass(f64),
    /// pass@1 ≥ this absolute value.
    Pass(f64),
    /// LLM share ≤ this.
    Share(f64),
}

impl Target {
    /// `pass>=0.9*large`, `pass>=0.6`, `share<=0.2` (percentages accepted: `90%*large`).
    pub fn parse(s: &str) -> Result<Target, String> {
        let t: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        let num = |v: &str| -> Result<f64, String> {
            let (v, scale) = match v.strip_suffix('%') {
                Some(v) => (v, 0.01),
                None => (v, 1.0),
            };
            v.parse::<f64>()
                .map(|x| x * scale)
                .map_err(|_| format!("`{v}` is not a number in --target {s}"))
        };
        if let Some(rest) = t.strip_prefix("pass>=") {
            match rest.strip_suffix("*large") {
                Some(f) => Ok(Target::RelativePass(num(f)?)),
                None => Ok(Target::Pass(num(rest)?)),
            }
        } else if let Some(rest) = t.strip_prefix("share<=") {
            Ok(Target::Share(num(rest)?))
        } else {
            Err(format!(
                "--target {s}: expected `pass>=0.9*large`, `pass>=0.6` or `share<=0.2`"
            ))
        }
    }
}

/// The sweep point meeting `target` most cheaply (pass targets: lowest LLM share) or best
/// (share targets: highest pass@1); `Err` says why none does.
pub fn calibrate<'a>(
    rows: &'a [VariantSummary],
    target: &Target,
) -> Result<&'a VariantSummary, String> {
    let routed: Vec<&VariantSummary> = rows
        .iter()
        .filter(|r| r.role == Role::Routed && r.llm_share.is_some())
        .collect();
    if routed.is_empty() {
        return Err("no routed variant with a known LLM share to calibrate from".into());
    }
    let share = |r: &VariantSummary| r.llm_share.unwrap_or(1.0);
    let need = match target {
        Target::RelativePass(f) => {
            let large = rows
                .iter()
                .find(|r| r.role == Role::Large)
                .ok_or("a relative target needs the large model's variant")?;
            Some(f * large.pass_at_1)
        }
        Target::Pass(p) => Some(*p),
        Target::Share(_) => None,
    };
    let pick =
        match (need, target) {
            (Some(need), _) => routed
                .iter()
                .filter(|r| r.pass_at_1 + 1e-12 >= need)
                .min_by(|a, b| share(a).total_cmp(&share(b))),
            (None, Target::Share(max)) => routed
                .iter()
                .filter(|r| share(r) <= *max + 1e-12)
                .max_by(|a, b| {
                    a.pass_at_1
                        .total_cmp(&b.pass_at_1)
                        .then(share(b).total_cmp(&share(a)))
                }),
            _ => None,
        };
    pick.copied()
        .ok_or_else(|| "no sweep point meets the target; widen the sweep".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_row as row;

    #[test]
    fn targets_parse_and_pick_the_cheapest_or_best_point() {
        let rows = vec![
            row("large", Role::Large, 0.8, 1.0),
            row("a", Role::Routed, 0.5, 0.05),
            row("b", Role::Routed, 0.7, 0.2),
            row("c", Role::Routed, 0.75, 0.4),
        ];
        let t = Target::parse("pass >= 0.9*large").expect("parse");
        assert_eq!(t, Target::RelativePass(0.9));
        assert_eq!(calibrate(&rows, &t).expect("pick").variant, "c");
        assert_eq!(
            calibrate(&rows, &Target::parse("pass>=85%*large").unwrap())
                .unwrap()
                .variant,
            "b"
        );
        assert_eq!(
            calibrate(&rows, &Target::parse("share<=0.3").unwrap())
                .unwrap()
                .variant,
            "b"
        );
        assert_eq!(
            calibrate(&rows, &Target::parse("share<=20%").unwrap())
                .unwrap()
                .variant,
            "b"
        );
        assert!(calibrate(&rows, &Target::parse("pass>=0.99").unwrap()).is_err());
        assert!(Target::parse("quality>=1").is_err());
        assert!(Target::parse("pass>=x").is_err());
    }
}
