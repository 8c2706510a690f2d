//! Router-level tests of every endpoint and error (axum oneshot, no port), streaming
//! format, provenance, disconnect aborts, graceful shutdown, and the end-to-end run of the
//! official `openai` Python client. One test binary keeps link time low.

mod background_responses;
mod batch;
mod cached_tokens;
mod common;
mod echo;
mod endpoints;
mod errors;
mod fuzz;
mod generate;
mod llama;
mod messages;
mod mock;
mod openai_client;
mod reasoning;
mod responses;
mod shutdown;
mod stored_responses;
mod streaming;
mod structured;
mod tools;
mod vllm_fields;
