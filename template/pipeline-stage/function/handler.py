"""A pipeline-stage function (created by `faas-cli new --lang pipeline-stage`).

All stages of a model share this handler; the stage to serve comes from the environment that the
model's stack.yml sets (written by `quartctl partition`): QUART_MODEL_DIR, QUART_STAGE_INDEX,
QUART_NUM_STAGES, QUART_COMPUTE. The parameters load when gunicorn imports this module, once, before
its workers fork.

handle(event, context) follows OpenFaaS's python3-http contract: event.body (bytes), event.headers,
event.method, event.query, event.path; it returns {"statusCode": int, "body": ..., "headers": {...}}.
"""

from quart_stage.handler import StageHandler

handle = StageHandler.from_env()
