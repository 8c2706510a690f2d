//! An answer's text read as chat reads it, piece by piece: the thinking apart (with
//! `--reasoning-parser`), then tool calls out of the rest. The Responses and Messages APIs
//! build their own items and blocks from what it shows.

use crate::params::GenerationPlan;
use crate::reasoning::{ReasoningReader, Split};
use crate::tools::{Shown, ToolCallReader};

pub struct AnswerReader {
    reasoning: Option<ReasoningReader>,
    tools: Option<ToolCallReader>,
}

impl AnswerReader {
    pub fn new(plan: &GenerationPlan) -> Self {
        Self {
            reasoning: plan.reasoning.map(ReasoningReader::new),
            tools: plan
                .tool_names
                .clone()
                .map(|names| ToolCallReader::new(names).one_call_at_most(plan.single_tool_call)),
        }
    }

    /// The next piece of text (`last` at the answer's end: nothing is held back then): its
    /// thinking, its content and the calls it completed.
    pub fn push(&mut self, text: &str, last: bool) -> Shown {
        let Split { content, reasoning } = match self.reasoning.as_mut() {
            Some(reader) => reader.push(text, last),
            None => Split {
                content: text.to_string(),
                reasoning: String::new(),
            },
        };
        let shown = match self.tools.as_mut() {
            Some(reader) => reader.push(&content, last),
            None => Shown {
                content,
                ..Shown::default()
            },
        };
        Shown { reasoning, ..shown }
    }
}
