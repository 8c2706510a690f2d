//! The inter-model loop: moves requests between sub-servers as messages and remembers
//! which models hold KV for each request, so that finishing or aborting a request frees
//! its KV on every model it touched. In async mode it runs on its own thread; in sync
//! (lockstep) mode the driver calls it inline between ticks.

use crate::request::Req;
use crate::subserver::{Inbound, Outbound};
use std::collections::HashMap;
use tokenrouter_api::ModelIndex;

pub enum ToExchange {
    /// A new request from a client.
    Submit(Box<Req>),
    /// Something a sub-server produced.
    Out(ModelIndex, Outbound),
    /// Every model forgets its cached prefixes; submissions after it come after it.
    FlushCache,
    Shutdown,
}

pub struct Exchange {
    /// Bitmask of models that have seen each live request.
    touched: HashMap<u64, u64>,
    models: usize,
}

impl Exchange {
    pub fn new(models: usize) -> Self {
        Self {
            touched: HashMap::new(),
            models,
        }
    }

    /// Route one message; `deliver` puts an inbound message into a model's inbox.
    pub fn handle(&mut self, msg: ToExchange, deliver: &mut dyn FnMut(ModelIndex, Inbound)) {
        match msg {
            ToExchange::Submit(req) => {
                let to = req.pinned.unwrap_or(0);
                *self.touched.entry(req.rid).or_default() |= 1 << to;
                deliver(to, Inbound::Admit(req));
            }
            ToExchange::Out(_, Outbound::Handoff { req, to }) => {
                *self.touched.entry(req.rid).or_default() |= 1 << to;
                deliver(to, Inbound::Admit(req));
            }
            ToExchange::Out(from, Outbound::Done { rid }) => {
                let mask = self.touched.remove(&rid).unwrap_or(0);
                for m in 0..64 {
                    if m != from && mask & (1 << m) != 0 {
                        deliver(m, Inbound::Free(rid));
                    }
                }
            }
            ToExchange::FlushCache => {
                for m in 0..self.models {
                    deliver(m, Inbound::FlushCache);
                }
            }
            ToExchange::Shutdown => {}
        }
    }

    pub fn live_requests(&self) -> usize {
        self.touched.len()
    }
}
