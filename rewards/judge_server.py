"""An OpenAI-compatible chat-completions endpoint in front of a local judge model.

``mintflow judge-serve --model embedded --port 8000`` serves the in-process judge at
``http://127.0.0.1:8000/v1``, so the ``http`` judge backend (and anything that speaks the
protocol) can use it; replies are greedy. Concurrent requests are batched by the engine.
"""


import time
import uuid

from rewards.judge import LocalJudge


def create_app(model: str):
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    class Message(BaseModel):
        role: str
        content: str

    class ChatRequest(BaseModel):
        model: str = ""  # one model is served, whatever the request names
        messages: list[Message] = Field(min_length=1)
        max_tokens: int | None = Field(None, ge=1, le=4096)
        temperature: float = 0.0

    judge = LocalJudge(model)  # annotations stay evaluated (no __future__ import): FastAPI reads the local models
    app = FastAPI(title="mintflow judge")

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "mintflow"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest) -> dict:
        try:
            [text] = judge.chat([[m.model_dump() for m in request.messages]], max_tokens=request.max_tokens or 64)
        except ValueError as e:  # e.g. a prompt longer than the model's context
            raise HTTPException(status_code=400, detail=str(e)) from e
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                             "finish_reason": "stop"}]}

    return app


def serve(model: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(create_app(model), host=host, port=port, log_level="warning")
