//! Any bytes as a request body: parsing is total (a value or a clear
//! error), never a panic.
#![no_main]

use gateway::protocol::body;
use gateway::protocol::chat::ChatRequest;
use gateway::protocol::completions::CompletionRequest;
use gateway::protocol::responses::ResponsesRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = body::object(data) {
        let _ = ChatRequest::parse(&body, 512);
        let _ = CompletionRequest::parse(&body, 512);
        let _ = ResponsesRequest::parse(&body, 512);
    }
});
