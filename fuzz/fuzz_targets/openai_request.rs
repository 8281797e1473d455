//! Any bytes as a request body: parsing is total (a value or a clear
//! error), never a panic.
#![no_main]

use gateway::api::chat::ChatRequest;
use gateway::api::completions::CompletionRequest;
use gateway::api::validate::RawBody;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = RawBody::parse(data) {
        let _ = ChatRequest::parse(&body, 512);
        let _ = CompletionRequest::parse(&body, 512);
    }
});
