//! Several choices in one response: `n` > 1, and completions' prompt lists
//! (`n` choices of each prompt, indexed prompt by prompt). Every choice is a
//! generation of its own, routed like any request. The first choice of a
//! prompt starts alone; the others start once it has prefilled the prompt,
//! so they take its KV from the shared prefix cache instead of computing
//! it again. Streamed, the choices' chunks interleave, each naming its
//! choice by `index`; whole, the choices come in order; usage counts each
//! prompt once.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::future::{join_all, try_join_all};
use serde_json::Value;

use super::sse::{self, ChunkFormat};
use super::{json_response, with_route, ApiError};
use crate::generation::{Batch, Generation, Summary, Usage};
use crate::prepare::Prepared;
use crate::state::SharedState;

/// The started choices, in index order, and which of them lead their
/// prompt.
pub struct Choices {
    generations: Vec<Generation>,
    leads: Vec<bool>,
}

impl Choices {
    /// Starts `n` choices of each prompt.
    pub async fn start(
        state: &SharedState,
        prompts: Vec<Prepared>,
        n: u32,
    ) -> Result<Self, ApiError> {
        let mut leads = Vec::with_capacity(prompts.len());
        for p in &prompts {
            leads.push(Generation::start(state, p.choice(0))?);
        }
        if n > 1 {
            join_all(leads.iter_mut().map(Generation::started)).await;
        }
        let mut generations = Vec::with_capacity(prompts.len() * n as usize);
        let mut is_lead = Vec::with_capacity(generations.capacity());
        for (p, lead) in prompts.iter().zip(leads) {
            generations.push(lead);
            is_lead.push(true);
            for i in 1..n {
                generations.push(Generation::start(state, p.choice(i))?);
                is_lead.push(false);
            }
        }
        Ok(Self {
            generations,
            leads: is_lead,
        })
    }

    /// The response: streamed with `formats` (one per choice), or whole,
    /// each choice's object built by `whole` and merged. Headers name the
    /// first choice's engine and rule.
    pub async fn respond<F: ChunkFormat>(
        self,
        stream: bool,
        formats: Vec<F>,
        whole: impl Fn(usize, &Batch, &Summary) -> Value,
    ) -> Response {
        let first = &self.generations[0];
        let (engine, rule) = (first.engine.clone(), first.rule.clone());
        let response = if stream {
            sse::response_choices(
                self.generations.into_iter().zip(formats).collect(),
                self.leads,
            )
        } else {
            match try_join_all(self.generations.into_iter().map(Generation::collect)).await {
                Ok(done) => {
                    let objects = done
                        .iter()
                        .enumerate()
                        .map(|(i, (batch, summary))| whole(i, batch, summary))
                        .collect();
                    let usage = Usage::merged(
                        self.leads
                            .into_iter()
                            .zip(done.iter().map(|(_, s)| s.usage)),
                    );
                    json_response(StatusCode::OK, &merge(objects, usage))
                }
                Err(e) => e.into_response(),
            }
        };
        with_route(response, &engine, &rule)
    }
}

/// One response object of several single-choice ones: their choices in
/// order, indexed, and the usage of all.
fn merge(objects: Vec<Value>, usage: Usage) -> Value {
    let mut choices = Vec::with_capacity(objects.len());
    let mut merged = Value::Null;
    for (i, mut object) in objects.into_iter().enumerate() {
        if let Some(Value::Array(mut own)) = object.get_mut("choices").map(Value::take) {
            for mut choice in own.drain(..) {
                choice["index"] = i.into();
                choices.push(choice);
            }
        }
        if merged.is_null() {
            merged = object;
        }
    }
    merged["choices"] = Value::Array(choices);
    merged["usage"] = usage.to_json();
    merged
}
