//! Held-out measures of a router: ROC AUC, precision and recall at a threshold, and the
//! threshold that reaches a target recall or a target share of routed positions.

/// Area under the ROC curve (the probability that a random positive scores above a random
/// negative; ties count half). `None` without both classes.
pub fn auc(scores: &[f32], labels: &[bool]) -> Option<f64> {
    let pos = labels.iter().filter(|&&l| l).count();
    let neg = labels.len() - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    // Mid-ranks over ties, then the Mann-Whitney U statistic of the positives.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let mid = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            if labels[k] {
                rank_sum += mid;
            }
        }
        i = j + 1;
    }
    let u = rank_sum - (pos * (pos + 1)) as f64 / 2.0;
    Some(u / (pos as f64 * neg as f64))
}

/// What routing at `p >= threshold` does on labelled data.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AtThreshold {
    pub threshold: f64,
    pub precision: f64,
    pub recall: f64,
    /// Share of positions routed.
    pub share: f64,
}

pub fn at_threshold(scores: &[f32], labels: &[bool], threshold: f64) -> AtThreshold {
    let (mut tp, mut fp, mut pos) = (0usize, 0usize, 0usize);
    for (&s, &l) in scores.iter().zip(labels) {
        let routed = s as f64 >= threshold;
        pos += l as usize;
        tp += (routed && l) as usize;
        fp += (routed && !l) as usize;
    }
    AtThreshold {
        threshold,
        precision: tp as f64 / (tp + fp).max(1) as f64,
        recall: tp as f64 / pos.max(1) as f64,
        share: (tp + fp) as f64 / scores.len().max(1) as f64,
    }
}

/// How the threshold written into the router is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ThresholdTarget {
    /// The largest threshold whose recall is at least this (R2R's rule; 0.95 there).
    Recall(f64),
    /// The threshold routing this share of positions.
    Share(f64),
}

/// The threshold for a target, from held-out scores.
pub fn choose_threshold(scores: &[f32], labels: &[bool], target: ThresholdTarget) -> f64 {
    let mut sorted: Vec<f32> = scores.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted.is_empty() {
        return 0.5;
    }
    match target {
        ThresholdTarget::Share(s) => {
            let n = ((s.clamp(0.0, 1.0) * sorted.len() as f64).round() as usize).max(1);
            sorted[n.min(sorted.len()) - 1] as f64
        }
        ThresholdTarget::Recall(r) => {
            let mut pos_scores: Vec<f32> = scores
                .iter()
                .zip(labels)
                .filter(|(_, &l)| l)
                .map(|(&s, _)| s)
                .collect();
            if pos_scores.is_empty() {
                return 0.5;
            }
            pos_scores.sort_by(|a, b| b.total_cmp(a));
            let need = ((r.clamp(0.0, 1.0) * pos_scores.len() as f64).ceil() as usize).max(1);
            pos_scores[need.min(pos_scores.len()) - 1] as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_by_hand() {
        // Positives 0.9, 0.4; negatives 0.5, 0.1: pairs won 1 + 1 + 0 + 1 of 4.
        let s = [0.9, 0.5, 0.4, 0.1];
        let l = [true, false, true, false];
        assert_eq!(auc(&s, &l), Some(0.75));
        assert_eq!(auc(&[0.5, 0.5], &[true, false]), Some(0.5));
        assert_eq!(auc(&[0.2], &[true]), None);
    }

    #[test]
    fn thresholds_reach_their_targets() {
        let s = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0];
        let l = [
            true, false, true, false, true, false, false, false, false, true,
        ];
        let t = choose_threshold(&s, &l, ThresholdTarget::Recall(0.75));
        assert_eq!(t, 0.5f32 as f64);
        let m = at_threshold(&s, &l, t);
        assert_eq!(m.recall, 0.75);
        assert_eq!(m.share, 0.5);
        assert_eq!(m.precision, 0.6);
        let t = choose_threshold(&s, &l, ThresholdTarget::Share(0.3));
        assert_eq!(at_threshold(&s, &l, t).share, 0.3);
    }
}
