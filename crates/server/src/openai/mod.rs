//! OpenAI wire types (requests and responses), kept apart from the handlers so their
//! shapes can be read in one place.

pub mod request;
pub mod response;
