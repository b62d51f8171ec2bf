package e2e

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

// FindBinDir returns the directory of the weft binaries: $WEFT_BIN_DIR if set,
// else bin/ at the root of the weft module, found by walking up from the
// working directory to its go.mod (tests run in their package's directory).
// `make build` fills it.
func FindBinDir() (string, error) {
	if d := os.Getenv("WEFT_BIN_DIR"); d != "" {
		return filepath.Abs(d)
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("e2e: finding the weft bin dir: %w", err)
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if isWeftModule(filepath.Join(dir, "go.mod")) {
			return filepath.Join(dir, "bin"), nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("e2e: no weft bin dir: %s is not inside the %s module; set WEFT_BIN_DIR to the directory of the weft binaries", wd, module)
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
		return "", fmt.Errorf("e2e: %s not found in %s: run `make build` at the root of the repository, or set WEFT_BIN_DIR", name, dir)
	case err != nil:
		return "", fmt.Errorf("e2e: %s: %w", p, err)
	case st.IsDir() || st.Mode()&0o111 == 0:
		return "", fmt.Errorf("e2e: %s is not an executable file: rebuild it with `make build`", p)
	}
	return p, nil
}
