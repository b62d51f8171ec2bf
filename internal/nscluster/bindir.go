package nscluster

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// module is the path that FindBinDir looks for in go.mod.
const module = "github.com/weft-net/weft"

// FindBinDir returns the directory of the weft binaries (weft, weft-cni,
// portmap): $WEFT_BIN_DIR if set; else the directory of the running
// program if a weft binary is there (an installed `weft demo`, or a
// program built beside them); else bin/ at the root of the weft module,
// found by walking up from the working directory to its go.mod (tests run
// in their package's directory, from a temporary binary). `make build`
// fills bin/.
func FindBinDir() (string, error) {
	if d := os.Getenv("WEFT_BIN_DIR"); d != "" {
		return filepath.Abs(d)
	}
	exe, err := os.Executable()
	if err == nil {
		exe, err = filepath.EvalSymlinks(exe)
	}
	if err != nil {
		exe = ""
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the weft binaries: %w", err)
	}
	return binDirFrom(exe, wd)
}

// binDirFrom is FindBinDir without $WEFT_BIN_DIR, for the program exe
// (empty if unknown) run in the directory wd.
func binDirFrom(exe, wd string) (string, error) {
	if exe != "" {
		if _, err := binaryIn(filepath.Dir(exe), "weft"); err == nil {
			return filepath.Dir(exe), nil
		}
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if isWeftModule(filepath.Join(dir, "go.mod")) {
			return filepath.Join(dir, "bin"), nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("no weft binaries: the running program has no weft beside it and %s is not inside the %s module; "+
				"install weft, weft-cni and portmap in one directory, or set WEFT_BIN_DIR to theirs", wd, module)
		}
	}
}

// isWeftModule reports whether path is the go.mod of the weft module.
func isWeftModule(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) == module
		}
	}
	return false
}

// binaryIn returns dir/name if it is an executable file.
func binaryIn(dir, name string) (string, error) {
	p := filepath.Join(dir, name)
	st, err := os.Stat(p)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("%s not found in %s: install it beside weft (in the repository: `make build`), or set WEFT_BIN_DIR", name, dir)
	case err != nil:
		return "", fmt.Errorf("%s: %w", p, err)
	case st.IsDir() || st.Mode()&0o111 == 0:
		return "", fmt.Errorf("%s is not an executable file: reinstall it (in the repository: `make build`)", p)
	}
	return p, nil
}
