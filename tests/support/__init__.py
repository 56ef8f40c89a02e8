"""What several test folders share; tests/conftest.py imports this folder as the package
``support``, so a test imports ``from support import parity``.

- ``parity``: the parity task, the tiny loop config, comparing two runs' logs and trees
- ``models``: tiny and real pretrained policies (SmolLM2, a Qwen-like tokenizer) for the tests
- ``planned``: the check that a rollout gave exactly the trees it planned
- ``browser``: headless Chromium for the HTML the project writes
- ``kfp_standin``: a stand-in KFP API server on 127.0.0.1 for the real ``kfp.Client``
- ``repo_copy``: a copy of the working tree for commands that write into the repository
- ``commands``: the ```bash commands of a Markdown page, and running them in a docs copy
- ``render``: the manifests' overlays built with kustomize (also ``python tests/support/render.py``)
- ``image_requirements``: the images' requirements resolved against the wheels' metadata
- ``image_context``: an image's build context as docker sends it, installed apart from the
  checkout (the images' import checks, the local pipeline's steps)
- ``upstream_source``: the GPU image's pinned wheels, downloaded once, for the upstream check
- ``locks``: one pytest worker at a time through a block (filling a cache under build/)
- ``sync_worker``: an engine process for the weight-sync test
"""
